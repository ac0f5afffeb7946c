"""One rank's training loop: the same code for the canonical process (LocalComm: all 8 units, all rows)
and for every rank of a layout (its units through `comm`, its rows through `rows_shard`).

A `Trainer` holds its own copy of the trained depth's weights (`InMemoryWeights`: every non-block
tensor and blocks A..B whole; a rank reads and writes only its units of the unit-sharded ones) and an
`AdamW` over the pieces this rank holds. Step k (k = 1, 2, ... in order):
1. sample: the clean request noised from the step's seed, `step_seed(seed, k)` (`FlowObjective.sample`);
2. forward, loss, backward: `model_grads` on the weights as the previous step left them;
3. clip and update: `AdamW.step` (the global norm over every rank's pieces, then every piece in place).
The step's tensors (`TrainStep.tensors`) are named as a rank reports them (h3lab.run.tasks), under
`step{k}.`: `loss`, `loss.video`, `loss.audio`, `grad_norm`, `clip_coef`, every gradient the optimizer
read (`dw.<param>`, `block{i}.dw.<param>`, `block{i}.dw.<unit gradient>@u{u}`) and every weight after
the update (the same names with `w.` for `dw.`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.batch import check_seed, derived_seed
from h3lab.block import Trace
from h3lab.comm import BlockComm, LocalComm
from h3lab.config import model_param_shapes
from h3lab.model.backward import check_blocks
from h3lab.model.inputs import ModelInputs
from h3lab.model.transformer import RowsShard, prefixed
from h3lab.model.weights import InMemoryWeights, ModelWeights
from h3lab.train.adamw import AdamW, AdamWHyper
from h3lab.train.grads import model_grads
from h3lab.train.objective import FlowObjective
from h3lab.train.pieces import Piece, block_weight_pieces, non_block_pieces, piece_label
from h3lab.units import unit_weights

PHASES = ("forward_s", "backward_s", "clip_s", "update_s")


def step_seed(seed: int, step: int) -> int:
    """The seed of training step `step`'s sample (sigmas and noise): `derived_seed(seed, f"step{step}")`."""
    return derived_seed(seed, f"step{step}")


@dataclass(frozen=True, eq=False)
class TrainStep:
    """One step on one rank. `weights` are the trainer's own tensors: the next step overwrites them."""

    step: int  # 1 for the first step
    loss: Tensor  # [] float32, the objective's weighted loss (before the update)
    loss_per_modality: dict[str, Tensor]  # "video", "audio": [] float32
    grad_norm: Tensor  # [] float32, the global norm before clipping
    clip_coef: Tensor  # [] float32
    grads: dict[Piece, Tensor]  # this rank's gradients, as the optimizer read them, canonical order
    weights: dict[Piece, Tensor]  # this rank's weights after the update, canonical order
    timings: dict[str, float]  # PHASES: forward_s, backward_s (model_grads), clip_s, update_s (AdamW)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the step under its run name, `step{k}.` first (module docstring)."""
        p = f"step{self.step}."
        out = {f"{p}loss": self.loss} | {f"{p}loss.{m}": v for m, v in self.loss_per_modality.items()}
        out |= {f"{p}grad_norm": self.grad_norm, f"{p}clip_coef": self.clip_coef}
        out |= {p + piece_label(q, "dw"): t for q, t in self.grads.items()}
        return out | {p + piece_label(q, "w"): t for q, t in self.weights.items()}


class Trainer:
    """Training steps of blocks `blocks` (and everything around them) on one rank.

    Args:
        weights: where the initial weights come from (a checkpoint, synthetic); copied, never written.
        inputs: the clean request every step noises (on the weights' device).
        blocks: the trained depth, a contiguous ascending range A..B.
        hyper: AdamW's hyperparameters and the clip's max norm.
        seed: the run's seed; step k's sample draws from `step_seed(seed, k)`.
        objective: the rectified-flow objective (default: both modalities weighted 1).
        backend, comm, rows_shard: as `h3lab.train.grads.model_grads`; comm None is the single process.
        recompute: each block's forward rerun in the backward (memory of the blocks' inputs only) or kept
            from the forward (`model_grads`: the same bits, no forward twice).

    Raises:
        ValueError: a bad block range or seed, or weights the optimizer cannot hold.
    """

    def __init__(
        self,
        weights: ModelWeights,
        inputs: ModelInputs,
        *,
        blocks: Sequence[int],
        hyper: AdamWHyper,
        seed: int,
        objective: FlowObjective | None = None,
        backend: Backend,
        comm: BlockComm | None = None,
        rows_shard: RowsShard | None = None,
        recompute: bool = True,
    ) -> None:
        config = weights.config
        self.blocks, self.seed = check_blocks(blocks, config.num_layers), check_seed(seed)
        self.comm = LocalComm() if comm is None else comm
        self.inputs, self.backend, self.rows_shard, self.recompute = inputs, backend, rows_shard, recompute
        self.objective = FlowObjective() if objective is None else objective
        self.weights = InMemoryWeights.copy_of(weights, self.blocks)  # every rank holds whole blocks
        held = non_block_pieces({n: self.weights.tensor(n) for n in model_param_shapes(config, 0)})
        for i in self.blocks:  # views: the optimizer writes this rank's units into the held tensors
            held |= block_weight_pieces(i, unit_weights(self.weights.block(i), self.comm.units))
        self.optimizer = AdamW(held, config=config, comm=self.comm, hyper=hyper, backend=backend)
        self.steps_taken = 0

    def _grown(self, k: int) -> str:
        """What the earlier steps made of the weights, for an error in step k > 1 (computed on the way out)."""
        if k == 1:
            return ""
        lr = self.optimizer.hyper.lr
        return (
            f"; after step {k - 1}'s update (lr {lr:g}) the weights hold {_largest(self.optimizer.largest_weights())}"
        )

    def step(self, k: int, trace: Trace | None = None, mark: Callable[[str], None] | None = None) -> TrainStep:
        """Training step `k`, which must be the next one (module docstring).

        `trace` sees, under `step{k}.`, every op of `model_grads` in execution order, then every
        gradient the optimizer reads, in canonical order (`_traced_grads`); the optimizer reads what it
        returns. `mark(phase)` is called as "backward" (the gradients), "clip" and "update" end (a
        profiler's hook, h3lab.bench.train_profile); with a trace also as "trace" once the gradients
        are traced (between backward and clip: the stacks of unit gradients an untraced step never makes).

        Raises:
            ValueError: `k` is not the next step.
            NonFiniteGradError: a NaN or Inf gradient norm (h3lab.train.adamw); nothing changed, and
                the same step fails again (its sample is fixed by its seed).
            NonFiniteWeightError: the update left a NaN or Inf in a weight (the step and the pieces named).
            ValueError: anything the forward or backward refuses (a NaN or Inf they produce from the
                updated weights), under "step k: ", with the largest weights the earlier steps left.
        """
        if isinstance(k, bool) or k != self.steps_taken + 1:
            raise ValueError(f"step {k!r}; allowed: {self.steps_taken + 1}, the next step (steps run in order from 1)")
        tr = None if trace is None else prefixed(trace, f"step{k}.")
        try:
            g = model_grads(
                self.weights,
                self.inputs,
                self.objective,
                seed=step_seed(self.seed, k),
                blocks=self.blocks,
                backend=self.backend,
                comm=self.comm,
                rows_shard=self.rows_shard,
                trace=tr,
                recompute=self.recompute,
            )
        except ValueError as err:  # e.g. a NaN or Inf the updated weights' forward produced
            raise ValueError(f"step {k}: {err}{self._grown(k)}") from err
        if mark is not None:
            mark("backward")
        pieces = g.pieces()  # canonical order; AdamW.step names any piece missing or unexpected
        grads = {p: pieces[p] for p in self.optimizer.order if p in pieces} | pieces
        if tr is not None:
            grads = _traced_grads(grads, self.comm.units, tr)
            if mark is not None:
                mark("trace")
        record = self.optimizer.step(grads, mark)
        self.steps_taken = k
        timings = {"forward_s": g.timings["forward_s"], "backward_s": g.timings["backward_s"], **record.timings}
        return TrainStep(
            step=k,
            loss=g.loss,
            loss_per_modality=g.loss_per_modality,
            grad_norm=record.grad_norm,
            clip_coef=record.clip_coef,
            grads=grads,
            weights=dict(self.optimizer.weights),
            timings=timings,
        )


def _largest(maxima: dict[Piece, float], shown: int = 3) -> str:
    """The pieces of the largest max |w| (NaN first): "|w| up to 1.02e+30 in a, b, c and 111 more above 1e+29"."""
    order = sorted(maxima, key=lambda p: -math.inf if math.isnan(maxima[p]) else -maxima[p])
    top = maxima[order[0]]
    near = [p for p in order if math.isnan(maxima[p]) or maxima[p] >= top / 10]
    more = f" and {len(near) - shown} more above {top / 10:.3g}" if len(near) > shown else ""
    return f"|w| up to {top:.3g} in {', '.join(piece_label(p, 'w') for p in near[:shown])}{more}"


def _traced_grads(grads: dict[Piece, Tensor], units: range, trace: Trace) -> dict[Piece, Tensor]:
    """`grads` (canonical order) through `trace`: a replicated or non-block gradient as `[block{i}.]dw.<param>`
    ("replicated"); a unit-sharded one once per block and unit gradient, as `block{i}.dw.<unit gradient>`,
    this rank's units stacked in ascending order ("units", [U_local, ...]). Returns the traced tensors."""
    out: dict[Piece, Tensor] = {}
    for p in grads:
        if p in out:
            continue
        if p.unit is None:
            out[p] = trace(piece_label(p, "dw"), grads[p], "replicated")
            continue
        group = [Piece(p.block, p.name, u) for u in units]
        stacked = trace(piece_label(p._replace(unit=None), "dw"), torch.stack([grads[q] for q in group]), "units")
        out |= {q: stacked[j] for j, q in enumerate(group)}
    return {p: out[p] for p in grads}
