"""The contract's rule 6 (inputs are finite) checked with one host sync per model call, not per block.

A finiteness check counts NaN/Inf elements on the device and reads the counts on the host: a sync
that drains the GPU's queue. A block checks its inputs as its `PackedBatch` is made; a model call
makes ~3 batches per block (each block's input, each block's upstream gradient), so checked one by
one they stall the GPU that many times per step (python -m h3lab.bench.host_syncs counts them).

Inside `deferred_checks()` a check queues its counts on the device and returns; leaving the scope
reads every queued count with one host sync and raises the first check that found NaN or Inf,
with the message it would have raised at once. The first check in program order wins also when the
scope is left by another exception (a NaN's later consequence): the first cause is reported, the
other chained to it. Outside a scope every check is immediate. Scopes nest: an inner scope joins
the outer one. What a deferred check guards is a claim about bits, not memory: a block computing on
a NaN input reads no index out of range, so deferring a refusal to the end of the call loses
nothing but the compute spent on a result that is then refused.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

# what a check does with its host counts: raise ValueError naming what held NaN or Inf, else return
Verdict = Callable[[list[int]], None]

_PENDING: contextvars.ContextVar[list[tuple[Tensor, Verdict]] | None] = contextvars.ContextVar(
    "h3lab_deferred_finite_checks", default=None
)


def check_counts(counts_K: Tensor, verdict: Verdict) -> None:
    """`verdict(counts_K.tolist())` now, or when the enclosing `deferred_checks()` scope ends.

    `counts_K`: a 1-D integer tensor of non-finite counts on the device of every check of the scope.
    """
    assert counts_K.ndim == 1, counts_K.shape
    pending = _PENDING.get()
    if pending is None:
        verdict(counts_K.tolist())
    else:
        pending.append((counts_K, verdict))


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Queue `check_counts` inside; on leaving, one host sync reads them all (module docstring).

    Raises:
        ValueError: the first queued check that found NaN or Inf.
    """
    if _PENDING.get() is not None:  # an outer scope reads them
        yield
        return
    pending: list[tuple[Tensor, Verdict]] = []
    token = _PENDING.set(pending)
    try:
        yield
    except Exception as err:
        _PENDING.reset(token)
        token = None
        _first_refusal(pending, cause=err)
        raise
    finally:
        if token is not None:
            _PENDING.reset(token)
    _first_refusal(pending, cause=None)


def _first_refusal(pending: list[tuple[Tensor, Verdict]], *, cause: BaseException | None) -> None:
    """Run the queued verdicts in order on one read-back; the first refusal raises (from `cause`)."""
    if not pending:
        return
    try:
        # every count lives on the call's device: a dtype cast, then one read-back (tolist)
        counts = torch.cat([c.long() for c, _ in pending]).tolist()
    except Exception:  # the device itself failed (the cause): nothing can be read back
        if cause is None:
            raise
        return
    start = 0
    for c, verdict in pending:
        n = c.numel()
        try:
            verdict(counts[start : start + n])
        except ValueError as refusal:
            if cause is None:
                raise
            raise refusal from cause
        start += n
