"""What a run computes — one block, a chain of blocks, a denoising trajectory or training steps — with
one code path for the canonical single process and for every rank of a layout.

A rank reports flat tensor names whose form says how the parent reassembles them:
- `out`, `dx`: this rank's local rows (concatenated over row shards);
- `[step{k}.][block{i}.]dw.<unit-grad>@u{u}`: canonical unit u of a weight gradient, and
  `step{k}.block{i}.w.<unit-grad>@u{u}` of a weight after step k's update (collected over TP ranks);
- anything else (`dtemb`, replicated dW, `step{k}.video`, `step{k}.loss`, `step{k}.dw.<non-block
  parameter>`...): identical on every rank.
Canonical tensors use the assembled names: `out`, `dx`, `[block{i}.]dtemb`, `[step{k}.][block{i}.]dw.<parameter>`,
`step{k}.[block{i}.]w.<parameter>`, `step{k}.video`, `step{k}.audio`, `step{k}.loss`... (h3lab.train.step).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.batch import PackedBatch
from h3lab.block import BlockStep, Trace, block_step
from h3lab.comm import BlockComm, LocalComm
from h3lab.config import NUM_UNITS, H3Config, block_param_shapes
from h3lab.metrics import digest
from h3lab.model.chain import chain_step
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.run.problem import Problem
from h3lab.tensorname import TensorName
from h3lab.train.step import PHASES, Trainer
from h3lab.units import UNIT_GRAD_FIELDS, assemble_unit_grads, unit_slice, unit_weights
from h3lab.weights import BlockWeights

ROW_TENSORS = ("out", "dx")


@dataclass(frozen=True, eq=False)
class Inputs:
    """A problem's batch and (for one block) weights, built once per process and reused by every
    repeat: a repeat that built them between its barrier and its first collective would reach that
    collective as late as its build was slow (synthetic real-size weights are drawn on the CPU),
    and the other ranks' step would count the difference as their wait."""

    weights: BlockWeights | None  # None for a chain: its blocks' weights come from the model's provider
    batch: PackedBatch


def prepare(problem: Problem, device: torch.device) -> Inputs | None:
    """The inputs `compute` reuses across repeats; None for a trajectory or training (they build their own)."""
    if problem.task in ("trajectory", "train"):
        return None
    return Inputs(problem.weights(device) if problem.task == "block" else None, problem.batch(device))


@dataclass(frozen=True, eq=False)
class Computed:
    tensors: dict[str, Tensor]
    digests: dict[str, str]  # digests-only runs: sha256 of every non-row tensor, instead of the tensor
    timings: dict[str, float]


def compute(
    problem: Problem,
    comm: BlockComm,
    device: torch.device,
    *,
    backend: Backend,
    layout: Layout | None = None,
    rank: int = 0,
    trace: Trace | None = None,
    inputs: Inputs | None = None,
) -> Computed:
    """This rank's tensors (all of them for the canonical process, `layout=None`) and its timings.

    With `problem.digests` only the row tensors (out, dx) and scalars (a training step's loss, norm and
    clip coefficient) stay tensors; every other tensor becomes its digest as soon as it exists — a
    50-block real chain's weight gradients are 65 GB.
    `inputs` (`prepare(problem, device)`): the weights and batch to use instead of building them.
    `backend`: `problem.block_backend` on `device`, built once by the process's entry point.
    """
    shard = None if layout is None else _shard_fn(layout, rank)
    if problem.task == "trajectory":
        tensors, timings = _trajectory(problem, comm, device, backend, shard)
        return _split(tensors, problem.digests, timings)
    if problem.task == "train":
        return _train(problem, comm, device, backend, shard, trace)
    batch = inputs.batch if inputs is not None else problem.batch(device)
    local = batch if shard is None else shard(batch)
    if problem.task == "block":
        w = inputs.weights if inputs is not None and inputs.weights is not None else problem.weights(device)
        step = block_step(unit_weights(w, comm.units), local, comm, backend=backend, trace=trace)
        return _split(_step_tensors(step, None), problem.digests, step.timings)
    digests: dict[str, str] = {}

    def keep(i: int, step: BlockStep) -> BlockStep:
        if not problem.digests:
            return step
        digests.update({k: digest(v) for k, v in _step_tensors(step, i).items() if k not in ROW_TENSORS})
        return dataclasses.replace(step, dw_units={}, dw_replicated={}, dtemb=None)

    chain = chain_step(
        problem.model_weights(device),
        local,
        comm,
        problem.block_range,
        backend=backend,
        trace=trace,
        keep=keep,
    )
    tensors = {"out": chain.out, "dx": chain.dx}
    if not problem.digests:
        for i, step in chain.blocks.items():
            tensors |= {k: v for k, v in _step_tensors(step, i).items() if k not in ROW_TENSORS}
    return Computed(tensors, digests, dict(chain.timings))


def _split(tensors: dict[str, Tensor], digests: bool, timings: Mapping[str, float]) -> Computed:
    timings = dict(timings)  # read the step's clocks (h3lab.clock) once its results are wanted
    if not digests:
        return Computed(tensors, {}, timings)
    kept = {k: v for k, v in tensors.items() if k in ROW_TENSORS or v.dim() == 0}
    return Computed(kept, {k: digest(v) for k, v in tensors.items() if k not in kept}, timings)


def _train(
    problem: Problem, comm: BlockComm, device: torch.device, backend: Backend, shard, trace: Trace | None
) -> Computed:
    """`problem.steps` training steps (h3lab.train.step.Trainer); each step's tensors kept (copied to the
    CPU: the next step overwrites the weights) or digested as the step ends. Timings: each phase summed."""
    trainer = Trainer(
        problem.model_weights(device),
        problem.model_inputs(device),
        blocks=problem.block_range,
        hyper=problem.hyper(),
        seed=problem.seed,
        backend=backend,
        comm=comm,
        rows_shard=shard,
    )
    tensors, digests, timings = {}, {}, dict.fromkeys(PHASES, 0.0)
    for k in range(1, problem.steps + 1):
        step = trainer.step(k, trace=trace)
        kept = _split(step.tensors(), problem.digests, step.timings)
        tensors |= {name: t.to("cpu", copy=True) for name, t in kept.tensors.items()}
        digests |= kept.digests
        timings = {phase: timings[phase] + step.timings[phase] for phase in PHASES}
    return Computed(tensors, digests, timings)


def canonical(problem: Problem, device: torch.device, backend: Backend) -> Computed:
    """The single-process result: tensors under assembled names; digests under per-unit names (as ranks name them)."""
    c = compute(problem, LocalComm(), device, backend=backend)
    return Computed(assemble_units(c.tensors, problem.config(), units=range(NUM_UNITS)), c.digests, c.timings)


def _shard_fn(layout: Layout, rank: int) -> Callable:
    return lambda batch: SeqShard(layout, batch.num_rows).coshard(batch, rank)


def _step_tensors(step: BlockStep, block: int | None) -> dict[str, Tensor]:
    """A block step's tensors by name: out, dx, then `block{i}.` (a chain's block i) dtemb and dW."""
    named = (("out", step.out), ("dx", step.dx), (str(TensorName("dtemb", block=block)), step.dtemb))
    out = {k: v for k, v in named if v is not None}
    out |= {str(TensorName(f"dw.{k}", block=block)): v for k, v in step.dw_replicated.items()}
    units = step.dw_units.items()
    return out | {str(TensorName(f"dw.{k}", block=block, unit=u)): t for k, per in units for u, t in per.items()}


def _trajectory(problem: Problem, comm: BlockComm, device: torch.device, backend: Backend, shard) -> tuple[dict, dict]:
    from h3lab.model.trajectory import trajectory

    inputs = problem.model_inputs(device)
    start = time.perf_counter()
    traj = trajectory(
        problem.model_weights(device),
        inputs,
        steps=problem.steps,
        backend=backend,
        comm=comm,
        rows_shard=shard,
    )
    tensors = {}
    for k, s in enumerate(traj.latents_per_step):
        tensors |= {str(TensorName("video", step=k)): s.video, str(TensorName("audio", step=k)): s.audio}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return tensors, {"forward_s": time.perf_counter() - start, "backward_s": 0.0}  # sampling has no backward


def space_of(name: str) -> str:
    """Where a rank's tensor `name` sits in the canonical result (h3lab.parallel.assemble): rows, one
    canonical unit, or replicated."""
    if name in ROW_TENSORS:
        return "local"
    return "unit" if TensorName.parse(name).unit_slice else "replicated"


def assemble_units(tensors: dict[str, Tensor], config: H3Config, units: range) -> dict[str, Tensor]:
    """Replace `...dw.<grad>@u{u}` (and `...w.<grad>@u{u}`) entries by diffusers-shaped `...dw.<parameter>`
    (`...w.<parameter>`) covering `units`."""
    out, per_tensor = {}, {}
    for k, v in tensors.items():
        n = TensorName.parse(k)
        if not n.unit_slice:
            out[k] = v
        else:  # grouped by the name without its unit gradient and unit: (step, block, kind)
            whole = n.replace(body=n.kind, unit=None)
            per_tensor.setdefault(whole, {}).setdefault(n.param, {})[n.unit] = v
    for whole, grads in per_tensor.items():
        assert set(grads) == set(UNIT_GRAD_FIELDS), (str(whole), sorted(grads))
        for param, v in assemble_unit_grads(grads, units).items():
            out[str(whole.replace(body=f"{whole.body}.{param}"))] = v
    return out


def expected_shard(name: str, canon: dict[str, Tensor], config: H3Config, rows: slice) -> Tensor:
    """The slice of the canonical result that a rank's tensor `name` must equal byte for byte."""
    if name in ROW_TENSORS:
        return canon[name][rows]
    n = TensorName.parse(name)
    if not n.unit_slice:
        return canon[name]
    whole = {p: str(n.replace(body=f"{n.kind}.{p}", unit=None)) for p in block_param_shapes(config)}
    block = {p: canon[k] for p, k in whole.items() if k in canon}
    return unit_slice(unit_weights(BlockWeights(config, block, "canonical")), n.param, n.unit)


def num_rows(problem: Problem) -> int | None:
    """The packed rows a rank's row shards are cut from: the batch's (block, chain), the request's
    (train: its traced ops); None for a trajectory (nothing is compared or traced per row)."""
    if problem.task == "trajectory":
        return None
    return problem.model_inputs().num_rows if problem.task == "train" else problem.batch().num_rows
