"""Where the training step's time goes, part by part: h3lab's step against the eager step under torch.profiler.

    python -m h3lab.bench.train_profile --out F.json [the arguments of h3lab.bench.train_step]
        [--traces DIR]

The two sides of h3lab.bench.train_step (the same weights, request, samples and hyperparameters)
run `--warmup` untimed steps, then `--steps` (default 1) steps under torch.profiler (CUDA and CPU
activity). Each kernel is charged to the part of the step the host was in when it launched it
(h3lab.bench.step_parts), from markers the host plants as it passes:
- canonical (`Trainer.step`): its trace hook at the model's stages (`embed.hidden`, `stack.out`,
  `head.audio`, `loss.d.audio`, `d.stack.out`, `d.stack.in`) and its `mark` hook as the backward,
  the clip and the update end;
- eager (`EagerTrainer.step`): forward pre-hooks and full backward pre-hooks on diffusers' modules
  (the embedders and the token refiner, each block, the output norm and projections) and its `mark`
  hook as its phases end.
The parts, on both sides: sample + embed, stack forward, head, loss, head backward, stack
backward, embed backward (the token refiner, the embedders, the time MLP), clip, update; the
canonical side has one more between backward and clip, "trace (profiling only)": its trace hook
stacks each block's unit gradients, work the timed step does not do, kept out of the clip. The
record: per side and part the GPU time, launches, the host's time in the part and its longest
kernels; the parts side by side (ratio canonical / eager of GPU time). The profiler slows the
host, so the profiled steps' wall time is not the step's (h3lab.bench.train_step times it); a
part whose host time exceeds its GPU time is host-bound there. `--traces DIR` keeps the chrome
traces (tens of MB each).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from h3lab.backend import get_backend
from h3lab.bench import train_step
from h3lab.bench.gaps import MARK
from h3lab.bench.step_parts import by_part, side_by_side
from h3lab.config import H3Config
from h3lab.io.jsonfile import write_json
from h3lab.model.packing import request_of_rows
from h3lab.model.weights import SyntheticWeights
from h3lab.train.objective import FlowObjective
from h3lab.train.step import Trainer, step_seed

FIRST = "sample + embed"
# the profile's own work: the traced gradients' stacks (Trainer.step's "trace" mark), no part of a timed step
TRACE = "trace (profiling only)"
# a canonical marker (a trace name without its `step{k}.` prefix, or `phase:<mark>`) -> the part it opens
CANONICAL_PARTS = {
    "embed.hidden": "stack forward",
    "stack.out": "head",
    "head.audio": "loss",
    "loss.d.audio": "head backward",
    "d.stack.out": "stack backward",
    "d.stack.in": "embed backward",
    "phase:backward": TRACE,
    "phase:trace": "clip",
    "phase:clip": "update",
    "phase:update": FIRST,  # the next profiled step begins
}
# diffusers' modules of MiniMaxH3Transformer3DModel by part (a block: `transformer_blocks.<i>`)
EAGER_MODULES = {
    "embed": ("proj_in", "audio_proj_in", "context_embedder", "time_proj", "time_embedder", "token_refiner"),
    "stack": ("transformer_blocks",),
    "head": ("norm_out", "proj_out", "audio_proj_out"),
}
EAGER_PARTS = {
    "fwd:embed": FIRST,
    "fwd:stack": "stack forward",
    "fwd:head": "head",
    "phase:forward": "loss",
    "bwd:head": "head backward",
    "bwd:stack": "stack backward",
    "bwd:embed": "embed backward",
    "phase:backward": "clip",
    "phase:clip": "update",
    "phase:update": FIRST,  # the next profiled step's sample
}
STEP_PREFIX = re.compile(r"^step\d+\.")


def mark(name: str) -> None:
    """An instant marker `h3lab:<name>` on the profiler's host timeline."""
    with record_function(MARK + name):
        pass


def canonical_part(name: str) -> str | None:
    return CANONICAL_PARTS.get(STEP_PREFIX.sub("", name))


def _profiled(device: torch.device, run: Callable[[], None], keep: Path) -> Path:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(keep))
    return keep


def canonical(a: argparse.Namespace, weights: SyntheticWeights, inputs, traces: Path) -> dict[str, Any]:
    path = _canonical_trace(a, weights, inputs, traces)  # its trainer freed on return
    train_step.free_device(a.device)
    return by_part(path, canonical_part, FIRST)


def _canonical_trace(a: argparse.Namespace, weights: SyntheticWeights, inputs, traces: Path) -> Path:
    be = get_backend(a.backend, a.device)
    trainer = Trainer(
        weights, inputs, blocks=a.blocks, hyper=a.hyper, seed=a.seed, backend=be, recompute=a.recompute == "on"
    )
    for k in range(1, a.warmup + 1):
        trainer.step(k)

    def trace(name: str, t, space: str):
        mark(name)
        return t

    def run() -> None:
        for k in range(a.warmup + 1, a.warmup + a.steps + 1):
            trainer.step(k, trace=trace, mark=lambda phase: mark(f"phase:{phase}"))

    return _profiled(a.device, run, traces / "canonical.json")


@contextmanager
def eager_markers(model: torch.nn.Module) -> Iterator[None]:
    """Forward and backward pre-hooks on the model's modules of each EAGER_MODULES part, removed after."""
    handles = []
    for part, names in EAGER_MODULES.items():
        for name in names:
            module = getattr(model, name)
            for m in module if isinstance(module, torch.nn.ModuleList) else [module]:
                handles.append(m.register_forward_pre_hook(lambda *_, p=part: mark(f"fwd:{p}")))
                if any(q.requires_grad for q in m.parameters()):
                    handles.append(m.register_full_backward_pre_hook(lambda *_, p=part: mark(f"bwd:{p}")))
    try:
        with warnings.catch_warnings():  # a block's inputs need no gradient: the hook fires at its outputs'
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
    finally:
        for h in handles:
            h.remove()


def eager(a: argparse.Namespace, weights: SyntheticWeights, inputs, traces: Path) -> dict[str, Any]:
    path = _eager_trace(a, weights, inputs, traces)  # its trainer freed on return
    train_step.free_device(a.device)
    return by_part(path, EAGER_PARTS.get, FIRST)


def _eager_trace(a: argparse.Namespace, weights: SyntheticWeights, inputs, traces: Path) -> Path:
    trainer, objective = train_step.make_eager(a, weights), FlowObjective()

    def step(k: int, phase_mark: Callable[[str], None] | None = None) -> None:
        sample = objective.sample(inputs, step_seed(a.seed, k))
        trainer.step(sample.inputs, sample.target, phase_mark)

    for k in range(1, a.warmup + 1):
        step(k)

    def run() -> None:
        with eager_markers(trainer.model):
            for k in range(a.warmup + 1, a.warmup + a.steps + 1):
                step(k, lambda phase: mark(f"phase:{phase}"))

    return _profiled(a.device, run, traces / "eager.json")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--traces", type=Path, default=None)
    own, rest = ap.parse_known_args(argv)
    try:
        a = train_step.parse_args(["--steps", "1", *rest])  # the same checks; --steps: profiled steps
    except ValueError as err:
        print(f"python -m h3lab.bench.train_profile: error: {err}", file=sys.stderr)
        return 2
    if a.device.type != "cuda":
        print(
            "python -m h3lab.bench.train_profile: error: --device cpu; allowed: cuda (it charges CUDA kernels)",
            file=sys.stderr,
        )
        return 2
    a.argv = argv
    config = H3Config.named(a.config)
    weights = SyntheticWeights(config, seed=a.seed, device=a.device, generator=a.device)
    inputs = request_of_rows(config, a.rows, a.seed + 1).to(a.device)
    header = train_step.header(a) | {"format": "h3lab-bench-train-profile-v1", "status": "running"}
    header["what"] = "one training step's GPU time by part under torch.profiler: " + header["what"]
    header["command"] = "python -m h3lab.bench.train_profile " + " ".join(argv)
    write_json(a.out, header)
    with tempfile.TemporaryDirectory() as tmp:
        traces = own.traces or Path(tmp)
        traces.mkdir(parents=True, exist_ok=True)
        parts = {"canonical": canonical(a, weights, inputs, traces), "eager": eager(a, weights, inputs, traces)}
    record = header | {"status": "complete", "rows": inputs.num_rows, "parts": parts}
    record["side_by_side"] = side_by_side(parts["canonical"], parts["eager"])
    write_json(a.out, record)
    for row in record["side_by_side"]:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        print(f"{row['part']:16s} canonical {row['canonical_ms']:8.2f} ms  eager {row['eager_ms']:8.2f} ms  {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
