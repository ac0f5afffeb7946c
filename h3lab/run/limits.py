"""Upper bounds on a run's request, checked before any process starts: `check_request(problem)`.

A request is refused when the memory it needs is more than the machine has, or when it asks for a
block past the model. The need is estimated from the config, the task and the backend for the
process that holds the most, the canonical one (all eight units, every row): its working set on its
device, plus the tensors the run keeps, which the runner then holds twice on the host (the canonical
result and a layout's, assembled beside it). The estimate counts what the code holds at its peak:
- per row, ROW_VECTORS FP32 vectors of the block's widths (hidden + attention + SwiGLU);
- the torch and baseline attention's [H, S, S] FP32 score arrays (SCORE_ARRAYS of them at the peak,
  the float64 exp's temporaries among them); the Triton kernels hold no score array;
- a block's weights WEIGHT_COPIES times (the weights, their FP32 operands, their gradients); a
  training run's trained depth TRAIN_COPIES times (bf16 weights, FP32 masters, two FP32 moments,
  gradients, in units of the weights' bytes);
- the kept results: out and dx, every weight gradient (and a training step's weights), each
  trajectory step's latents; a digests run keeps DIGEST_BYTES per digest instead.
The coefficients are sized on the peak resident memory of the canonical process (a tiny block at
264 to 2048 rows on a CPU; a real block and training step on an H200, reports/h200/block-long.json,
train-step.json): an estimate, not a promise, that refuses what cannot fit rather than every
request that might not. The machine's memory is its total (the same number in the runner and in
every worker), the GPU's for the device-resident part of a CUDA run. The refusal says the estimate,
the memory and the largest value of the field that fits, all else as asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from h3lab.config import H3Config, block_param_shapes, model_param_shapes, param_dtype

# the emulator (emulate-sm90) holds a few copies of each GEMM operand (h3lab.emulate.wgmma) and its
# attention one key block of scores at a time
ROW_VECTORS = {"torch": 12, "baseline": 12, "triton": 6, "emulate-sm90": 24}
SCORE_ARRAYS = {"torch": 24, "baseline": 6, "triton": 0, "emulate-sm90": 0}
WEIGHT_COPIES = 4
TRAIN_COPIES = 8
DIGEST_BYTES = 256  # a sha256 digest and its tensor name, as a rank's record and the runner hold them
PROCESS_BYTES = 512 << 20  # a process with torch imported, before it allocates anything
MAX_REPEATS = 1000  # timing repeats of one block step: a median settles within tens
# a synthetic config stands for MiniMax-H3: its blocks reach as deep as the real model's
SYNTHETIC_DEPTH = H3Config.real().num_layers


class Request(Protocol):
    """What the bounds read of a request: an h3lab.run.problem.Problem (the runner's RunRequest and
    h3lab accuracy call `check_request` on theirs)."""

    synthetic: str | None
    task: str
    block: int
    rows: int
    padding: int
    steps: int
    text_rows: int
    repeats: int
    device: str
    digests: bool

    @property
    def block_range(self) -> range: ...

    @property
    def block_backend(self) -> str: ...

    def config(self) -> H3Config: ...


@dataclass(frozen=True)
class Need:
    """Bytes a request needs: `work` on its device, `kept` results (on the host, and the device's too
    for a CUDA run's chain, which keeps them there until it ends)."""

    work: int
    kept: int

    def host(self, device: str) -> int:
        return PROCESS_BYTES + (self.work + self.kept if device == "cpu" else 0) + 2 * self.kept

    def device(self) -> int:
        return self.work + self.kept


def check_request(problem: Request, *, host_bytes: int | None = None, device_bytes: int | None = None) -> None:
    """Refuse a request that cannot fit this machine, or asks for blocks or repeats past their bounds.

    `host_bytes`, `device_bytes`: the memory to check against (default: this machine's host memory,
    and the first GPU's for a CUDA run).

    Raises:
        ValueError: naming the field, its value, the estimate, the memory and the largest value allowed.
    """
    for name in ("rows", "padding", "repeats", "steps", "text_rows", "block"):
        value = getattr(problem, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r}; allowed: an int")
    if problem.repeats > MAX_REPEATS:
        raise ValueError(f"repeats={problem.repeats}; allowed: 1..{MAX_REPEATS} (timing repeats of one block step)")
    last = problem.block_range.stop - 1
    if problem.synthetic is not None and last >= SYNTHETIC_DEPTH:
        raise ValueError(
            f"block {last}: a synthetic config has as many blocks as MiniMax-H3 ({SYNTHETIC_DEPTH}); "
            f"allowed: 0..{SYNTHETIC_DEPTH - 1}"
        )
    config = problem.config()
    fields = _fields(problem)
    limits = {"host": host_bytes if host_bytes is not None else _host_memory()}
    if problem.device == "cuda":
        limits["GPU"] = device_bytes if device_bytes is not None else _gpu_memory()

    def over(values: dict[str, int]) -> str | None:
        """The memory the request with `values` does not fit ("host", "GPU"), or None."""
        need = estimate(config, problem.task, problem.block_backend, problem.digests, **values)
        needs = {"host": need.host(problem.device), "GPU": need.device()}
        return next((where for where in limits if needs[where] > limits[where]), None)

    where = over(fields)
    if where is None:
        return
    need = estimate(config, problem.task, problem.block_backend, problem.digests, **fields)
    needed = need.host(problem.device) if where == "host" else need.device()
    asked = ", ".join(f"{_LABELS[k]}={v}" for k, v in fields.items())
    allowed = _largest_fitting(fields, lambda values: over(values) is None)
    raise ValueError(
        f"{asked}: the canonical process would need ~{_gib(needed)} of {where} memory ({problem.task} task, "
        f"{problem.synthetic or 'checkpoint'} config, backend {problem.block_backend}); this machine has "
        f"{_gib(limits[where])}; allowed: {allowed}"
    )


_LABELS = {"rows": "rows + padding", "text_rows": "text_rows", "steps": "steps", "blocks": "blocks"}


def _fields(problem: Request) -> dict[str, int]:
    """The request's sizes the estimate reads: packed rows (or text rows), steps, blocks."""
    fields = {"blocks": len(problem.block_range)}
    if problem.task in ("trajectory", "train"):
        return {"text_rows": problem.text_rows, "steps": problem.steps} | fields
    return {"rows": problem.rows + problem.padding} | fields


def _largest_fitting(fields: dict[str, int], fits: Callable[[dict[str, int]], bool]) -> str:
    """'<field> <= N' for the first field whose reduction alone makes the request fit."""
    for name, value in fields.items():
        if not fits(fields | {name: 1}):
            continue
        lo, hi = 1, value  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(fields | {name: mid}) else (lo, mid)
        return f"{_LABELS[name]} <= {lo}"
    return "a smaller request (not even one row, step and block fits)"


def estimate(
    config: H3Config,
    task: str,
    backend: str,
    digests: bool,
    *,
    blocks: int,
    rows: int | None = None,
    text_rows: int | None = None,
    steps: int = 1,
) -> Need:
    """The bytes of the canonical process of a `task` request (module docstring): `rows` packed rows of a
    block or chain, or a trajectory's or training run's request of `text_rows` text rows."""
    if task in ("trajectory", "train"):
        from h3lab.model.packing import model_inputs_rows

        rows = model_inputs_rows(config, text_rows)  # type: ignore[arg-type]
    assert rows is not None
    D, H = config.hidden_size, config.num_attention_heads
    per_row = ROW_VECTORS[backend] * 4 * (D + config.inner_dim + config.ffn_dim)
    scores = SCORE_ARRAYS[backend] * 4 * H * rows * rows
    block_w = sum(math.prod(s) * 2 for s in block_param_shapes(config).values())  # block weights are bf16
    outside = sum(math.prod(s) * param_dtype(k).itemsize for k, s in model_param_shapes(config, 0).items())
    one_block = WEIGHT_COPIES * block_w + per_row * rows + scores
    row_results = 2 * rows * D * 2  # out and dx in bf16
    saved = blocks * rows * D * 2  # a chain's block inputs, kept for the recompute
    if task == "block":
        return Need(one_block, row_results + _kept(block_w, 13, digests))
    if task == "chain":
        return Need(one_block + saved, row_results + blocks * _kept(block_w, 13, digests))
    if task == "trajectory":
        latents = rows * max(config.video_patch_dim, config.audio_in_channels) * 4
        return Need(one_block + outside, steps * latents)
    depth = outside + blocks * block_w
    tensors = len(model_param_shapes(config, 0)) + blocks * 8 * 12  # per unit slice when digested
    return Need(TRAIN_COPIES * depth + one_block + saved, steps * 2 * _kept(depth, tensors, digests))


def _kept(nbytes: int, tensors: int, digests: bool) -> int:
    return tensors * DIGEST_BYTES if digests else nbytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def _host_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def _gpu_memory() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory
