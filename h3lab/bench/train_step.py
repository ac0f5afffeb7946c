"""The training step's speed: h3lab's canonical step against the eager PyTorch step of the same depth,
in one run, written as one JSON record.

    python -m h3lab.bench.train_step --out F.json [--config real|tiny] [--blocks 0-3] [--rows N]
        [--steps S] [--warmup W] [--lr X] [--device cuda|cpu] [--backend triton|torch] [--seed N]
        [--recompute off|on]

On an H200 (real shapes, blocks 0-3 with the embedders, token refiner and heads; the eager side needs
diffusers 0.42.1, the `parity` extra, which a GPU node without it takes from a carried wheel; `h3lab
publish --node h200` runs this through its benchmark registry):

    python -m h3lab.bench.train_step --out reports/h200/train-step.json --config real --blocks 0-3 \\
        --rows 4096 --steps 5 --warmup 2 --device cuda --backend triton

The two sides train the same depth from the same weights (`SyntheticWeights`, the checkpoint's mixed
precision) on the same request (`request`: exactly N packed rows), step k drawing the same sample
(`h3lab.train.step.step_seed(seed, k)`) with the same AdamW hyperparameters and clip:
- canonical: `h3lab.train.step.Trainer.step` (sample, forward, loss, backward through the whole depth,
  clip, AdamW on FP32 masters), its per-phase times (forward, backward, clip, update) its own; by
  default each block's forward is kept for its backward (`--recompute off`), as autograd keeps the
  eager side's activations;
- eager: what a user would run instead, `h3lab.reference.eager_train.EagerTrainer` (diffusers' model,
  autograd, the loss in plain PyTorch, `clip_grad_norm_`, `torch.optim.AdamW` fused on CUDA and
  foreach on CPU, on FP32 master copies of the bf16 parameters; its docstring says how), the same
  `FlowObjective.sample` timed inside its step.
The sides run one after the other in one process (canonical first), each with its own weights, its
own `--warmup` untimed steps (the first compiles kernels and allocates the optimizer's state) and
`--steps` timed steps; the other side's tensors are freed before a side starts. Every step starts
after a synchronisation and is timed by CUDA events on a GPU (by the wall clock on a CPU); the
eager phases by events between its phases. The record: per step its seconds, phases, losses and
grad norm (warm-up steps included, flagged); per side the median, min, max and quartiles of the
timed steps and the medians of the phases; on CUDA the memory allocated before the timed steps and
the peak over them; the ratio of the medians (canonical / eager); both losses per step and their
relative gap (each step draws its own sample, so the loss moves with its noise level: what compares
is the two sides at one step; `--lr` defaults to 1e-5, small against the weights' N(0, 1/fan_in)
scale, 0.014 at the real width 5376, since Adam's first steps move every weight by about lr); and the
canonical step's repeatability: step 1 of a fresh `Trainer` from the same weights, and of one with
the other `--recompute`, against the timed trainer's step 1, by a digest of every tensor the step
reports (loss, every gradient, every updated weight). The record is written at the start (`status:
running`), after the canonical side, and at the end (`complete`, or `failed` / `interrupted` with
the error: an exception, Ctrl-C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from h3lab.backend import get_backend
from h3lab.bench.step_timing import StepClock, run_side
from h3lab.config import NAMED_CONFIGS, H3Config
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.metrics import digest
from h3lab.model.backward import check_blocks
from h3lab.model.inputs import ModelInputs
from h3lab.model.packing import min_request_rows, request_of_rows
from h3lab.model.weights import SyntheticWeights
from h3lab.reference.eager_train import PHASES as EAGER_PHASES
from h3lab.reference.eager_train import EagerTrainer, depth_state
from h3lab.train.adamw import AdamWHyper
from h3lab.train.objective import FlowObjective
from h3lab.train.step import PHASES as CANONICAL_PHASES
from h3lab.train.step import Trainer, TrainStep, step_seed

BENCH_FORMAT = "h3lab-bench-train-step-v1"
PROG = "python -m h3lab.bench.train_step"


def parse_blocks(text: str, num_layers: int) -> tuple[int, ...]:
    """`A-B` or `A` as the block range A..B, inside the model's `num_layers` blocks.

    Raises:
        ValueError: not of that form, or a range `check_blocks` refuses.
    """
    parts = text.split("-")
    if not (1 <= len(parts) <= 2 and all(p.isdigit() for p in parts)):
        raise ValueError(f"--blocks {text!r}; allowed: A-B or A, block indices in 0..{num_layers - 1}")
    first, last = int(parts[0]), int(parts[-1])
    return check_blocks(range(first, last + 1) if last >= first else [first, last], num_layers)


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown choice, a non-number) as ValueError: one line, like ours."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any work.

    Raises:
        ValueError: one line naming the value and what is allowed, for every value that cannot run.
    """
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON record (a new file)")
    ap.add_argument("--config", default="real", choices=NAMED_CONFIGS)
    ap.add_argument("--blocks", default="0-3", help="the trained depth A-B (with the embedders and heads)")
    ap.add_argument("--rows", type=int, default=4096, help="packed rows of the request")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first (>= 1)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--backend", default=None, choices=("triton", "torch"), help="canonical kernels (cuda: triton)")
    ap.add_argument("--seed", type=int, default=0, help="weights, request and every step's sample derive from it")
    ap.add_argument(
        "--recompute",
        default="off",
        choices=("off", "on"),
        help="canonical side: 'off' keeps each block's forward for its backward, as autograd keeps the eager "
        "side's activations; 'on' reruns it in the backward (memory of the blocks' inputs only)",
    )
    a = ap.parse_args(argv)
    config = H3Config.named(a.config)
    a.blocks = parse_blocks(a.blocks, config.num_layers)
    if a.rows < min_request_rows(config):
        raise ValueError(f"--rows {a.rows}; allowed: >= {min_request_rows(config)} (text, a keyframe, a frame, audio)")
    for name in ("steps", "warmup"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name} {getattr(a, name)}; allowed: >= 1 (a warm-up step compiles and allocates)")
    try:
        a.hyper = AdamWHyper(lr=a.lr)
    except ValueError as err:
        raise ValueError(f"--lr: {err}") from None
    if not 0 <= a.seed < 2**63:
        raise ValueError(f"--seed {a.seed}; allowed: 0 <= seed < 2**63")
    a.backend = a.backend or ("triton" if a.device == "cuda" else "torch")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here; allowed: --device cpu")
    if a.backend == "triton" and a.device != "cuda":
        raise ValueError("--backend triton runs on --device cuda only; allowed on cpu: --backend torch")
    if a.out.exists():
        raise ValueError(f"--out {a.out} exists; allowed: a new file (a record is never overwritten)")
    a.device = torch.device(a.device)
    return a


def step_digest(step: TrainStep) -> str:
    """sha256 over every tensor the step reports, by name in its order (each by `h3lab.metrics.digest`)."""
    h = hashlib.sha256()
    for name, t in step.tensors().items():
        h.update(f"{name}={digest(t)};".encode())
    return h.hexdigest()


def _losses(loss: Tensor, per_modality: dict[str, Tensor], grad_norm: Tensor) -> dict[str, float]:
    out = {"loss": float(loss)} | {f"loss_{m}": float(v) for m, v in per_modality.items()}
    return out | {"grad_norm": float(grad_norm)}


def built_and_run(
    make: Callable[[], Any], step: Callable[..., dict[str, Any]], a: argparse.Namespace
) -> dict[str, Any]:
    """`run_side` over the trainer `make()` builds (its build timed): `step(trainer, k, clock)`. The
    trainer is dropped on return, so the next one never shares the device with it."""
    start = time.perf_counter()
    trainer = make()
    build_s = time.perf_counter() - start
    out = run_side(lambda k, clock: step(trainer, k, clock), a.warmup, a.steps, a.device)
    return out | {"build_s": build_s}


def canonical_side(a: argparse.Namespace, weights: SyntheticWeights, inputs: ModelInputs) -> dict[str, Any]:
    """`Trainer.step` timed (module docstring), then step 1 of a fresh Trainer against the timed one's."""
    be = get_backend(a.backend, a.device)  # every trainer's kernels
    recompute = a.recompute == "on"

    def make(recompute: bool = recompute) -> Trainer:
        return Trainer(weights, inputs, blocks=a.blocks, hyper=a.hyper, seed=a.seed, backend=be, recompute=recompute)

    first: dict[str, str] = {}

    def step(trainer: Trainer, k: int, clock: StepClock) -> dict[str, Any]:
        clock.start()
        s = trainer.step(k)
        total, _ = clock.stop()
        if k == 1:  # after the clock: the digest reads every tensor of the step
            first["digest"] = step_digest(s)
        phases = {p.removesuffix("_s"): s.timings[p] for p in CANONICAL_PHASES}
        other = total - sum(phases.values())  # sampling, the loss, Python between the phases
        return {"step": k, "seconds": total, "phases": phases | {"other": other}} | _losses(
            s.loss, s.loss_per_modality, s.grad_norm
        )

    out = built_and_run(make, step, a)
    free_device(a.device)
    again = step_digest(make().step(1))
    free_device(a.device)
    other = step_digest(make(not recompute).step(1))  # the forwards kept vs recomputed: the same bits
    free_device(a.device)
    repeat = {"step": 1, "digest": first["digest"], "digest_fresh_trainer": again, "digest_other_recompute": other}
    return out | {"repeat": repeat | {"bitwise": again == first["digest"] == other}}


def make_eager(a: argparse.Namespace, weights: SyntheticWeights) -> EagerTrainer:
    """The eager side's trainer: diffusers' model of the depth `a.blocks` from `weights`, torch's AdamW."""
    h = a.hyper
    return EagerTrainer(
        weights.config.replace(num_layers=len(a.blocks)),
        depth_state(weights, a.blocks),
        lr=h.lr,
        betas=h.betas,
        eps=h.eps,
        weight_decay=h.weight_decay,
        max_grad_norm=h.max_grad_norm,
        loss_weights=FlowObjective().weights,
    )


def eager_side(a: argparse.Namespace, weights: SyntheticWeights, inputs: ModelInputs) -> dict[str, Any]:
    """`EagerTrainer.step` on `FlowObjective.sample` of each step's seed, timed phase by phase."""
    objective = FlowObjective()

    def step(trainer: EagerTrainer, k: int, clock: StepClock) -> dict[str, Any]:
        clock.start()
        sample = objective.sample(inputs, step_seed(a.seed, k))
        clock.mark("sample")
        r = trainer.step(sample.inputs, sample.target, clock.mark)
        total, phases = clock.stop()
        assert tuple(phases) == ("sample", *EAGER_PHASES), phases
        return {"step": k, "seconds": total, "phases": phases} | _losses(r.loss, r.loss_per_modality, r.grad_norm)

    out = built_and_run(lambda: make_eager(a, weights), step, a)
    free_device(a.device)
    return out


def free_device(device: torch.device) -> None:
    """On CUDA: wait for the device, then hand the freed blocks back (a side never inherits another's)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def header(a: argparse.Namespace) -> dict[str, Any]:
    """What the record was made with: the arguments, the model, the optimizer, the objective, the clock."""
    config = H3Config.named(a.config)
    h, objective = a.hyper, FlowObjective()
    return {
        "format": BENCH_FORMAT,
        "what": "one training step (sample, forward, loss, backward, clip, AdamW) of the same depth: "
        "h3lab.train.step.Trainer against diffusers + autograd + torch.optim.AdamW (h3lab.reference.eager_train)",
        "command": f"{PROG} " + " ".join(a.argv),
        "args": {
            k: str(v) if isinstance(v, (Path, torch.device)) else v
            for k, v in vars(a).items()
            if k not in ("hyper", "argv")
        }
        | {"blocks": list(a.blocks)},
        "config": config.to_dict(),
        "hyper": {"lr": h.lr, "betas": list(h.betas), "eps": h.eps, "weight_decay": h.weight_decay}
        | {"max_grad_norm": h.max_grad_norm},
        "objective": {"weights": dict(objective.weights), "video_shift": objective.video_shift}
        | {"audio_shift": objective.audio_shift},
        "seeds": {"weights": a.seed, "request": a.seed + 1, "step k": "h3lab.train.step.step_seed(seed, k)"},
        "clock": "CUDA events, synchronised before each step" if a.device.type == "cuda" else "wall clock",
        "order": ["canonical", "eager"],
        "env": capture_env(a.device),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }


def bench(a: argparse.Namespace) -> dict[str, Any]:
    """Both sides (module docstring), the record grown as they finish; written after each."""
    config = H3Config.named(a.config)
    record = header(a) | {"status": "running"}
    write_json(a.out, record)
    weights = SyntheticWeights(config, seed=a.seed, device=a.device, generator=a.device)
    inputs = request_of_rows(config, a.rows, a.seed + 1).to(a.device)
    record["rows"] = inputs.num_rows
    record["canonical"] = canonical_side(a, weights, inputs)
    write_json(a.out, record)
    record["eager"] = eager_side(a, weights, inputs)
    return (
        record
        | compare(record["canonical"], record["eager"])
        | {
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "status": "complete",
        }
    )


def compare(canonical: dict[str, Any], eager: dict[str, Any]) -> dict[str, Any]:
    """The ratio of the timed medians (canonical / eager) and the losses of both, step by step."""
    losses = []
    for c, e in zip(canonical["steps"], eager["steps"], strict=True):
        gap = abs(c["loss"] - e["loss"]) / abs(c["loss"]) if c["loss"] else math.inf
        losses.append({"step": c["step"], "canonical": c["loss"], "eager": e["loss"], "rel_gap": gap})
    return {"ratio_median": canonical["timed"]["median_s"] / eager["timed"]["median_s"], "losses": losses}


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a `timeout`, a closed terminal): stops the run as Ctrl-C does."""


@contextlib.contextmanager
def _final_status(a: argparse.Namespace) -> Iterator[None]:
    """A record that stops short ends `failed` or `interrupted` (Ctrl-C, SIGTERM, SIGHUP), with the
    error, never `running`; the signal handlers are restored after."""

    def stop(signum: int, frame: object) -> None:
        raise Terminated(signal.Signals(signum).name)

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except BaseException as err:
        if a.out.exists():
            status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            write_json(a.out, _read(a.out) | {"status": status, "error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; a bad argument is one line on stderr and exit status 2, before any work."""
    try:
        a = parse_args(argv)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with _final_status(a):
        record = bench(a)
        write_json(a.out, record)
    c, e = record["canonical"]["timed"], record["eager"]["timed"]
    print(
        f"{a.config} blocks {a.blocks[0]}-{a.blocks[-1]}, {record['rows']} rows, {a.device.type}/{a.backend}: "
        f"canonical {c['median_s']:.4g} s, eager {e['median_s']:.4g} s (median of {a.steps}), "
        f"ratio {record['ratio_median']:.3g}; step 1 repeatable: {record['canonical']['repeat']['bitwise']}; "
        f"{a.out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
