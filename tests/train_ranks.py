"""Training-state helpers for tests: a model's weights and fresh random gradients as pieces, split over
TP ranks, and a TP group of threads in one process standing in for a layout's comm.

`ThreadComm.gather_units` concatenates every rank's part in rank order (= unit order), which is what
DistComm's all_gather delivers: it moves bytes only, so the code under test runs exactly as on a
layout, every rank with its own units and its own call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from h3lab.config import H3Config, model_param_shapes
from h3lab.contract import units_of_rank
from h3lab.train.pieces import Piece, block_weight_pieces, canonical_pieces, non_block_pieces
from h3lab.units import unit_weights
from h3lab.weights import synthetic_block, synthetic_tensor

# every structural feature of tiny at ~1/40 of its elements: a refiner block, units of 9 SwiGLU columns
# and 81 AdaLN rows (81 x 20 = 1620 elements: two clip row blocks, the last padded), odd widths; small
# enough that a training step of it is cheap on a CPU
NARROW = H3Config.tiny().replace(
    attention_head_dim=16,
    rope_freq_dim=2,
    hidden_size=36,
    ffn_dim=72,
    text_dim=24,
    freq_dim=16,
    time_embed_hidden_dim=40,
    time_embed_dim=20,
    num_refiner_layers=1,
)
BARRIER_S = 120  # a rank that raised before its gather breaks the others' wait instead of hanging them


class ThreadGroup:
    """A TP group of `size` threads; rank r holds units_of_rank(r, size)."""

    def __init__(self, size: int) -> None:
        self.size, self.parts = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=BARRIER_S)
        self.calls: list[str] = []


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank
        self.units = units_of_rank(rank, group.size)

    def gather_units(self, part: Tensor, site: str, *, dim: int) -> Tensor:
        g = self.group
        if self.rank == 0:
            g.calls.append(site)
        g.parts[self.rank] = part.clone()
        g.barrier.wait()
        out = torch.cat(g.parts, dim=dim)
        g.barrier.wait()  # nobody overwrites a part before every rank has read them all
        return out


def run_ranks(size: int, fn: Callable[[int, ThreadComm], Any]) -> list[Any]:
    """fn(rank, comm) on `size` threads of one TP group; the results by rank, or the first error raised."""
    group = ThreadGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadComm(group, rank))
        except BaseException as err:  # handed to the caller below
            errors[rank] = err
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None or any(errors):
        raise first or next(e for e in errors if e is not None)
    return results


def model_weights(config: H3Config, blocks: range, units: range, seed: int) -> dict[Piece, Tensor]:
    """Fresh synthetic weights of `blocks` and every non-block parameter, as a rank holding `units` reads
    them (views into its own copy, which the optimizer writes)."""
    out: dict[Piece, Tensor] = {}
    for i in blocks:
        out |= block_weight_pieces(i, unit_weights(synthetic_block(config, i, seed=seed), units))
    names = model_param_shapes(config, 0)
    return out | non_block_pieces({n: synthetic_tensor(config, n, seed) for n in names})


def random_grads(weights_all: dict[Piece, Tensor], config: H3Config, seed: int, scale: float) -> dict[Piece, Tensor]:
    """Fresh N(0, scale^2) gradients in each weight's dtype for every piece of `weights_all` (all units),
    drawn in canonical order; a piece's scale also varies by 4x so no piece dominates by size alone."""
    order = canonical_pieces(
        config, {p.block for p in weights_all if p.block is not None}, {p.name for p in weights_all if p.block is None}
    )
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, p in enumerate(order):
        w = weights_all[p]
        out[p] = (torch.randn(w.shape, generator=gen) * (scale * (1 + 3 * (k % 5) / 4))).to(w.dtype)
    return out


def for_units(pieces: dict[Piece, Tensor], units: range) -> dict[Piece, Tensor]:
    """The pieces a rank holding `units` holds."""
    return {p: t for p, t in pieces.items() if p.unit is None or p.unit in units}
