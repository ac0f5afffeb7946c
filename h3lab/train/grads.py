"""One training step's loss and gradients, without the optimizer: a pure function of (weights, the
clean request, the objective, the step's seed) per rank.

`model_grads` draws the step's noise (`FlowObjective.sample`), runs the trained depth forward
(`h3lab.model.backward.model_forward`), scores it (`FlowObjective.loss`) and runs the backward from
the loss's gradient (`model_backward`). Under a layout every rank returns the same loss and
replicated gradients, and the unit slices of the blocks' unit-sharded gradients it holds; the
canonical process holds all 8 units.

Names a rank reports (`ModelGrads.tensors`, the scheme of h3lab.run.tasks, under a prefix such as
`step{k}.`): `loss`, `loss.video`, `loss.audio`; `dw.<parameter>` for every non-block parameter;
`block{i}.dw.<parameter>` for block i's norm weights; `block{i}.dw.<unit gradient>@u{u}` for unit
u of its unit-sharded gradients (`h3lab.units.assemble_unit_grads` names them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from h3lab.backend import Backend
from h3lab.block import Trace
from h3lab.comm import BlockComm
from h3lab.config import BLOCK_PREFIX, NUM_UNITS
from h3lab.finite import deferred_checks
from h3lab.model.backward import model_backward, model_forward
from h3lab.model.inputs import ModelInputs
from h3lab.model.transformer import RowsShard
from h3lab.model.weights import ModelWeights
from h3lab.train.objective import FlowObjective
from h3lab.train.pieces import Piece, block_grad_pieces, piece_label
from h3lab.units import assemble_unit_grads


@dataclass(frozen=True, eq=False)
class ModelGrads:
    """One rank's loss and gradients of one step."""

    loss: Tensor  # [] float32, the objective's weighted loss
    loss_per_modality: dict[str, Tensor]  # "video", "audio": [] float32, unweighted
    replicated: dict[str, Tensor]  # diffusers name -> gradient: every non-block parameter, each block's norms
    units: dict[int, dict[str, dict[int, Tensor]]]  # block -> unit-gradient name -> unit -> slice (this rank's)
    timings: Mapping[str, float]  # forward_s, backward_s (the whole model), stack_forward_s, stack_backward_s

    def tensors(self, prefix: str = "") -> dict[str, Tensor]:
        """Every tensor under the flat name a rank reports (see the module docstring), `prefix` first."""
        out = {f"{prefix}loss": self.loss} | {f"{prefix}loss.{m}": v for m, v in self.loss_per_modality.items()}
        return out | {prefix + piece_label(p, "dw"): t for p, t in self.pieces().items()}

    def pieces(self) -> dict[Piece, Tensor]:
        """Every gradient this rank holds by piece (h3lab.train.pieces): what `AdamW.step` reads."""
        out = {}
        for name, t in self.replicated.items():
            if name.startswith(BLOCK_PREFIX):
                i, param = name.removeprefix(BLOCK_PREFIX).split(".", 1)
                out[Piece(int(i), param, None)] = t
            else:
                out[Piece(None, name, None)] = t
        for i, grads in self.units.items():
            out |= block_grad_pieces(i, grads, {})
        return out

    def assembled(self) -> dict[str, Tensor]:
        """Every gradient under its diffusers name, diffusers-shaped (the canonical process: all 8 units).

        Raises:
            ValueError: this rank holds only some units (a layout's rank: assemble across ranks instead).
        """
        out = dict(self.replicated)
        for i, grads in self.units.items():
            held = sorted({u for per in grads.values() for u in per})
            if held != list(range(NUM_UNITS)):
                raise ValueError(f"block {i}: this rank holds units {held}; allowed: all 8 (the canonical process)")
            out |= {f"{BLOCK_PREFIX}{i}.{k}": v for k, v in assemble_unit_grads(grads, range(NUM_UNITS)).items()}
        return out


@deferred_checks()
def model_grads(
    weights: ModelWeights,
    inputs: ModelInputs,
    objective: FlowObjective,
    *,
    seed: int,
    blocks: Sequence[int],
    backend: Backend,
    comm: BlockComm | None = None,
    rows_shard: RowsShard | None = None,
    trace: Trace | None = None,
    recompute: bool = True,
) -> ModelGrads:
    """The loss and every gradient of the trained depth for one step, on this rank.

    Args:
        weights: the parameters (e.g. `InMemoryWeights`, which an optimizer updates in place).
        inputs: the clean request: its video and audio rows are the data the step noises.
        objective: the rectified-flow objective (weights per modality, shifts).
        seed: the step's seed: its sigmas and noise (`FlowObjective.sample`).
        blocks: the trained depth, a contiguous ascending block range A..B.
        backend, comm, rows_shard: as `h3lab.model.transformer_forward`.
        trace: every block's forward and backward ops (`block{i}.{op}`) and the replicated stages,
            `loss.d.video` and `loss.d.audio` (the upstream gradient) among them.
        recompute: rerun each block's forward in the backward (memory of the blocks' inputs only), or
            keep its records from the forward (no forward twice; the same bits: h3lab.model.chain).

    Raises:
        ValueError: a bad seed or block range, or anything the model refuses.
    """
    sample = objective.sample(inputs, seed)
    fwd = model_forward(
        weights,
        sample.inputs,
        blocks=blocks,
        backend=backend,
        comm=comm,
        rows_shard=rows_shard,
        trace=trace,
        recompute=recompute,
    )
    loss = objective.loss(sample, fwd.output)
    if trace is not None:
        trace("loss", loss.total, "replicated")
        trace("loss.d.video", loss.grad.video, "replicated"), trace("loss.d.audio", loss.grad.audio, "replicated")
    grads = model_backward(fwd, loss.grad)
    return ModelGrads(loss.total, loss.per_modality, grads.replicated, grads.units, grads.timings)
