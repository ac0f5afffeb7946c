"""Your own training step through `h3lab.parallelize`: its bits under tp1 and tp2, and its time against
h3lab's own `Trainer` and against diffusers + autograd + `torch.optim.AdamW`, as one JSON record.

    python -m h3lab.bench.parallelize_step --out F.json [--config real|tiny] [--layers 4] [--rows N]
        [--steps S] [--device cuda|cpu] [--backend triton|torch] [--seed N] [--timeout SECONDS]
        [--order parallelize_flow,trainer,eager,parallelize_custom]

On one H200 (diffusers 0.42.1 is needed on every rank: the `parity` extra, from a carried wheel where
the node lacks it; `h3lab publish --node h200` runs this through its registry):

    python -m h3lab.bench.parallelize_step --out reports/h200/parallelize-step.json --config real \\
        --layers 4 --rows 4096 --steps 5 --device cuda --backend triton

A model of the real config's shapes with `--layers` blocks and synthetic weights (`SyntheticWeights`,
the checkpoint's mixed precision) trains on one request (`request_of_rows`: exactly N rows), AdamW
(lr 1e-5) with a clip at 1. Two launches through h3lab.launch.launcher, the ranks in this module (`--worker`):
- tp1, one process, four sides one after the other (`--order`: another order shows what a side's
  place costs it), each on its own copy of the weights (the other side's tensors freed first):
  `parallelize_flow` (a parallelized diffusers model trained on h3lab's objective through autograd,
  `flow_matching_loss` on `FlowObjective.sample` of step k's seed, with `h3lab.optim`: the work of a
  `Trainer` step, so its time against `trainer` is the wrapper's cost, target <= 1.03x), `trainer`
  (`h3lab.train.step.Trainer`), `eager` (h3lab.bench.train_step's eager side: diffusers + autograd +
  torch.optim.AdamW on FP32 masters), `parallelize_custom` (the same parallelized model on a loss of
  its own: an advantage-weighted, clamped MSE of the video head plus a cosine term on the audio head,
  on a fixed noised request);
- tp2, two processes (one GPU each where there are two; on one GPU both share it and the bytes
  travel over gloo through the host, NCCL refusing two ranks on one GPU, so its times are no speed
  figure): `parallelize_custom` again.
Every side runs steps 1 and 2 untimed (the first compiles the kernels), takes digests (h3lab.metrics
.digest) of every weight after step 2 and the bits of each step's loss and gradient norm, then times
`--steps` steps: each after a barrier of the layout's ranks and a device synchronisation, CUDA events on
a GPU (the wall clock on a CPU), medians and quartiles (h3lab.bench.step_timing), and phases: the
parallelized model's between its calls (sample, forward, loss, backward, clip, update; CUDA events),
Trainer's from its own clocks (`TrainStep.timings`: model_forward, model_backward, clip, update, each up
to a host sync), and `parallelize_flow`'s model_forward and model_backward from the same clocks (what
the wrapper adds around them is forward - model_forward, backward - model_backward). One more step
counts its host synchronisations by site (`host_syncs`); the record holds the sites where
`parallelize_flow` makes more than `trainer` (the target: none). Bitwise: tp2's `parallelize_custom`
against tp1's on both ranks; `parallelize_flow` against `trainer` (the loss, the norm, every weight
after step 2). The record is written at the start (`running`) and at the end (`complete`, or `failed`
with the launch that failed and its logs).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from h3lab.bench.step_timing import StepClock, run_side
from h3lab.config import NAMED_CONFIGS, H3Config
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.launch.launcher import launch
from h3lab.metrics import digest
from h3lab.model.packing import min_request_rows, request_of_rows
from h3lab.model.weights import SyntheticWeights
from h3lab.parallel.layout import Layout

BENCH_FORMAT = "h3lab-bench-parallelize-step-v1"
PROG = "python -m h3lab.bench.parallelize_step"
LAYOUTS = ("tp1", "tp2")
BITWISE_STEPS = 2  # untimed, then compared
TARGET = 1.03  # parallelize_flow / trainer, medians
LR, MAX_NORM = 1e-5, 1.0
ORDER = ("parallelize_flow", "trainer", "eager", "parallelize_custom")  # tp1's sides, as they run by default


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any work.

    Raises:
        ValueError: one line naming the value and what is allowed.
    """
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the JSON record (a new file)")
    ap.add_argument("--config", default="real", choices=NAMED_CONFIGS)
    ap.add_argument("--layers", type=int, default=4, help="blocks of the model (the embedders and heads around them)")
    ap.add_argument("--rows", type=int, default=4096, help="packed rows of the request")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side, after the 2 bitwise ones")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--backend", default=None, choices=("triton", "torch"), help="h3lab's kernels (cuda: triton)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    ap.add_argument("--order", default=",".join(ORDER), help="tp1's sides in the order they run, comma-separated")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # a rank: its spec
    a = ap.parse_args(argv)
    if a.worker is not None:
        return a
    if a.out is None:
        raise ValueError("--out is required; allowed: a new JSON file")
    if a.out.exists():
        raise ValueError(f"--out {a.out} exists; allowed: a new file (a record is never overwritten)")
    config = H3Config.named(a.config)
    if not 1 <= a.layers <= config.num_layers:
        raise ValueError(f"--layers {a.layers}; allowed: 1..{config.num_layers}")
    if a.rows < min_request_rows(config):
        raise ValueError(f"--rows {a.rows}; allowed: >= {min_request_rows(config)} (text, a keyframe, a frame, audio)")
    if a.steps < 1:
        raise ValueError(f"--steps {a.steps}; allowed: >= 1")
    if sorted(a.order.split(",")) != sorted(ORDER):
        raise ValueError(f"--order {a.order}; allowed: {','.join(ORDER)} in any order, each once")
    a.backend = a.backend or ("triton" if a.device == "cuda" else "torch")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here; allowed: --device cpu")
    if a.backend == "triton" and a.device != "cuda":
        raise ValueError("--backend triton runs on --device cuda only; allowed on cpu: --backend torch")
    return a


# ---- the parent: two launches, one record ------------------------------------------------------------
def bench(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    record: dict[str, Any] = {
        "format": BENCH_FORMAT,
        "what": "a training step through h3lab.parallelize (autograd, h3lab.optim) against h3lab.train.step."
        "Trainer and diffusers + autograd + torch.optim.AdamW; its bits under tp1 and tp2",
        "command": f"{PROG} " + " ".join(argv),
        "args": {k: str(v) for k, v in vars(a).items() if k != "worker"},
        "config": H3Config.named(a.config).replace(num_layers=a.layers).to_dict(),
        "hyper": {"lr": LR, "max_grad_norm": MAX_NORM},
        "env": capture_env(a.device),
        "status": "running",
    }
    write_json(a.out, record)
    work = a.out.parent / f"{a.out.stem}.ranks"
    record["layouts"] = {}
    for name in LAYOUTS:
        layout = Layout.parse(name)
        d = work / name
        d.mkdir(parents=True, exist_ok=True)
        spec = {k: str(v) for k, v in vars(a).items() if k not in ("worker", "out")} | {"layout": name, "dir": str(d)}
        write_json(d / "spec.json", spec)
        res = launch(
            "h3lab.bench.parallelize_step",
            ["--worker", str(d / "spec.json")],
            nproc_per_node=layout.world,
            log_dir=d,
            timeout_s=a.timeout,
        )
        if not res.ok:
            record |= {
                "status": "failed",
                "error": f"launch {name} exited {res.returncode} (timed out: {res.timed_out}); logs in {d}",
                "logs": [str(p) for p in res.agent_logs],
            }
            return record
        record["layouts"][name] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(layout.world)]
    return record | verdicts(record["layouts"]) | {"status": "complete"}


def verdicts(layouts: dict[str, list[dict]]) -> dict[str, Any]:
    """Bitwise and speed: tp2 against tp1, the parallelized model against Trainer, the medians' ratios."""
    one = layouts["tp1"][0]["sides"]
    bits = lambda side: {k: side[k] for k in ("losses", "norms", "weights")}  # noqa: E731
    tp2 = [r["sides"]["parallelize_custom"] for r in layouts["tp2"]]
    median = {k: v["timed"]["median_s"] for k, v in one.items()}
    return {
        "bitwise": {
            "tp2 = tp1 (parallelize_custom, every rank)": all(bits(s) == bits(one["parallelize_custom"]) for s in tp2),
            "parallelize_flow = trainer": bits(one["parallelize_flow"]) == bits(one["trainer"]),
        },
        "ratios": {
            "parallelize_flow / trainer": median["parallelize_flow"] / median["trainer"],
            "parallelize_custom / trainer": median["parallelize_custom"] / median["trainer"],
            "parallelize_flow / eager": median["parallelize_flow"] / median["eager"],
            "trainer / eager": median["trainer"] / median["eager"],
        },
        "target": {"parallelize_flow / trainer": TARGET},
        "within_target": median["parallelize_flow"] / median["trainer"] <= TARGET,
        "phases_median_s": {k: one[k]["phases_median_s"] for k in ("parallelize_flow", "trainer")},
        "host_syncs": sync_verdict(one["parallelize_flow"]["host_syncs"], one["trainer"]["host_syncs"]),
    }


def sync_verdict(flow: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    """One step's host synchronisations, the parallelized model's against Trainer's: the totals, and
    every site where the parallelized model makes more (none is the target: the same work)."""
    more = {
        site: {"parallelize_flow": n, "trainer": trainer["sites"].get(site, 0)}
        for site, n in flow["sites"].items()
        if n > trainer["sites"].get(site, 0)
    }
    totals = {k: {"parallelize_flow": flow[k], "trainer": trainer[k]} for k in ("total", "cuda_reported") if k in flow}
    return totals | {"parallelize_flow beyond trainer": more}


# ---- one rank ------------------------------------------------------------------------------------------
def worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx = context(spec)
    layout, device = ctx.layout, ctx.device
    sides: dict[str, Any] = {}
    names = ("parallelize_custom",) if layout.world > 1 else tuple(spec["order"].split(","))
    for name in names:
        sides[name] = SIDES[name](ctx)
        _free(device)
    transport = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    out = {"rank": rank, "world": world, "layout": layout.name, "device": str(device), "transport": transport}
    write_json(Path(spec["dir"]) / f"rank{rank}.json", out | {"sides": sides})
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def context(spec: dict[str, str]) -> types.SimpleNamespace:
    """What every side of a rank reads: the spec, the layout, the device (this rank's GPU), the weights
    and the request (made before any timing), the seed."""
    layout = Layout.parse(spec["layout"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    config = H3Config.named(spec["config"]).replace(num_layers=int(spec["layers"]))
    seed = int(spec["seed"])
    weights = SyntheticWeights(config, seed=seed, device=device, generator=device)
    inputs = request_of_rows(config, int(spec["rows"]), seed + 1).to(device)
    return types.SimpleNamespace(spec=spec, layout=layout, device=device, weights=weights, inputs=inputs, seed=seed)


def _model(ctx: types.SimpleNamespace):
    """A parallelized diffusers model of the depth, on its own copy of the weights."""
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3RotaryPosEmbed,
        MiniMaxH3Transformer3DModel,
    )

    import h3lab
    from h3lab.reference.eager_train import depth_state

    config = ctx.weights.config
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config.to_dict())
    model.load_state_dict(depth_state(ctx.weights, range(config.num_layers)), strict=True, assign=True)
    model.rope = MiniMaxH3RotaryPosEmbed(config.rope_freq_dim, config.rope_theta).to(ctx.device)
    return h3lab.parallelize(model, ctx.layout, backend=ctx.spec["backend"])


Mark = Callable[[str], None]  # the clock's mark: the phase that ends now
Step = Callable[[int, Mark], tuple[Tensor, Tensor, dict[str, float]]]  # k, mark -> loss, norm, phases it timed
Weights = Callable[[], dict[str, Tensor]]  # every weight whole, for the digests


def _no_mark(phase: str) -> None:
    return None


def _timed(ctx: types.SimpleNamespace, step: Step, weights: Weights) -> dict:
    """Steps 1-2 untimed and their bits, then `--steps` timed steps, then one more step's host
    synchronisations (module docstring)."""
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else (lambda: None)
    losses, norms = [], []
    for k in range(1, BITWISE_STEPS + 1):
        loss, norm, _ = step(k, _no_mark)
        losses.append(float(loss).hex()), norms.append(float(norm).hex())
    digests = {n: digest(t) for n, t in weights().items()}

    def timed(k: int, clock: StepClock) -> dict[str, Any]:
        barrier()
        clock.start()
        loss, norm, phases = step(BITWISE_STEPS + k, clock.mark)
        total, marked = clock.stop()
        return {
            "step": BITWISE_STEPS + k,
            "seconds": total,
            "phases": marked | phases,
            "loss": float(loss),
            "grad_norm": float(norm),
        }

    steps = int(ctx.spec["steps"])
    out = run_side(timed, 0, steps, ctx.device)
    barrier()
    syncs = host_syncs(lambda: step(BITWISE_STEPS + steps + 1, _no_mark), ctx.device)
    return out | {"losses": losses, "norms": norms, "weights": digests, "host_syncs": syncs}


def flow_step(ctx: types.SimpleNamespace) -> tuple[Step, Weights]:
    """`parallelize_flow`'s step (module docstring), its phases marked as each call returns, and
    model_forward's and model_backward's own clocks (as Trainer's)."""
    import h3lab.optim
    from h3lab.nn import diffusers_kwargs, flow_matching_loss, full_state_dict
    from h3lab.nn.state import state_of
    from h3lab.train.objective import FlowObjective
    from h3lab.train.step import step_seed

    model, objective = _model(ctx), FlowObjective()
    opt = h3lab.optim.AdamW(model.parameters(), lr=LR)
    state = state_of(model)

    def step(k: int, mark: Mark) -> tuple[Tensor, Tensor, dict[str, float]]:
        sample = objective.sample(ctx.inputs, step_seed(ctx.seed, k))
        kwargs = diffusers_kwargs(sample.inputs)
        mark("sample")
        out = model(**kwargs)
        mark("forward")
        loss = flow_matching_loss(objective, sample, out.sample[0], out.audio_sample[0])
        mark("loss")
        loss.backward()
        mark("backward")
        norm = h3lab.optim.clip_grad_norm_(model, MAX_NORM)
        mark("clip")
        opt.step()
        opt.zero_grad()
        mark("update")
        return loss.detach(), norm, {f"model_{p.removesuffix('_s')}": v for p, v in state.timings.items()}

    return step, lambda: full_state_dict(model)


def custom_step(ctx: types.SimpleNamespace) -> tuple[Step, Weights]:
    """`parallelize_custom`'s step (module docstring), its phases marked as each call returns."""
    import h3lab.optim
    from h3lab.nn import diffusers_kwargs, full_state_dict

    model = _model(ctx)
    opt = h3lab.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(ctx.seed + 2)
    i = ctx.inputs
    targets = [torch.randn(t.shape, generator=g).to(ctx.device) for t in (i.video_rows, i.audio_rows)]
    advantage = torch.randn(i.video_rows.shape[0], generator=g).to(ctx.device)
    kwargs = diffusers_kwargs(i)

    def step(k: int, mark: Mark) -> tuple[Tensor, Tensor, dict[str, float]]:
        out = model(**kwargs)
        mark("forward")
        mse = ((out.sample[0] - targets[0]) ** 2).mean(-1)
        cos = F.cosine_similarity(out.audio_sample[0], targets[1], dim=-1)
        loss = (advantage * mse.clamp(max=4.0)).mean() + 0.5 * (1 - cos).clamp(min=0.05).mean()
        mark("loss")
        loss.backward()
        mark("backward")
        norm = h3lab.optim.clip_grad_norm_(model, MAX_NORM)
        mark("clip")
        opt.step()
        opt.zero_grad()
        mark("update")
        return loss.detach(), norm, {}

    return step, lambda: full_state_dict(model)


def trainer_step(ctx: types.SimpleNamespace) -> tuple[Step, Weights]:
    """`trainer`'s step; its phases are its own clocks' (`TrainStep.timings`: model_forward's,
    model_backward's, the clip's, the update's; each up to a host sync)."""
    from h3lab.backend import get_backend
    from h3lab.train.adamw import AdamWHyper
    from h3lab.train.step import Trainer

    be = get_backend(ctx.spec["backend"], ctx.device)
    blocks = range(ctx.weights.config.num_layers)
    hyper = AdamWHyper(lr=LR, max_grad_norm=MAX_NORM)
    t = Trainer(ctx.weights, ctx.inputs, blocks=blocks, hyper=hyper, seed=ctx.seed, backend=be)

    def step(k: int, mark: Mark) -> tuple[Tensor, Tensor, dict[str, float]]:
        s = t.step(k)
        names = {"forward_s": "model_forward", "backward_s": "model_backward", "clip_s": "clip", "update_s": "update"}
        return s.loss, s.grad_norm, {names[p]: v for p, v in s.timings.items()}

    return step, lambda: dict(t.weights.tensors)


def parallelize_flow(ctx: types.SimpleNamespace) -> dict[str, Any]:
    return _timed(ctx, *flow_step(ctx))


def parallelize_custom(ctx: types.SimpleNamespace) -> dict[str, Any]:
    return _timed(ctx, *custom_step(ctx))


def trainer(ctx: types.SimpleNamespace) -> dict[str, Any]:
    return _timed(ctx, *trainer_step(ctx))


def eager(ctx: types.SimpleNamespace) -> dict[str, Any]:
    """h3lab.bench.train_step's eager side (its own warm-up of 2 steps, then `--steps` timed)."""
    from h3lab.bench.train_step import eager_side
    from h3lab.train.adamw import AdamWHyper

    blocks = tuple(range(ctx.weights.config.num_layers))
    a = types.SimpleNamespace(
        warmup=BITWISE_STEPS,
        steps=int(ctx.spec["steps"]),
        device=ctx.device,
        blocks=blocks,
        hyper=AdamWHyper(lr=LR, max_grad_norm=MAX_NORM),
        seed=ctx.seed,
    )
    return eager_side(a, ctx.weights, ctx.inputs)


# ---- host synchronisations of one step ---------------------------------------------------------------
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # h3lab/
_HOST_READS = ("_local_scalar_dense", "nonzero", "_unique", "unique", "equal", "masked_select")  # aten op names
_SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s


def host_syncs(run: Callable[[], object], device: torch.device) -> dict[str, Any]:
    """The host synchronisations `run()` makes: "sites" counts them by the innermost h3lab function on the
    stack ("h3lab/model/inputs.py:__post_init__"), "total" sums them; on CUDA "cuda_reported" is what
    torch itself reports (`torch.cuda.set_sync_debug_mode`, no sites: an autograd backward's reports
    reach the host at its end).

    Counted on every device alike, as calls that are a host sync on a GPU (a CPU never waits): an op that
    reads a tensor on the host (item, bool, int, float, nonzero, unique, equal, a boolean-mask index:
    torch's dispatcher sees them, in an autograd backward's thread too; tolist), and a blocking copy
    naming a device (`Tensor.cpu`, `Tensor.to`, `torch.tensor`, `torch.as_tensor`: a sync when one end
    is the host; named, not seen, so counted wherever the tensor is).
    """
    sites: dict[str, int] = {}

    def note() -> None:
        site = _site(sys._getframe(1))
        sites[site] = sites.get(site, 0) + 1

    reported = _cuda_reported(lambda: _noted(run, note)) if device.type == "cuda" else None
    if reported is None:
        _noted(run, note)
    out: dict[str, Any] = {"sites": dict(sorted(sites.items())), "total": sum(sites.values())}
    return out | ({"cuda_reported": reported} if device.type == "cuda" else {})


def _site(frame: Any) -> str:
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE + os.sep) and frame.f_code not in _COUNTER_CODE:
            return f"h3lab/{os.path.relpath(path, _PACKAGE)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside h3lab"


def _cuda_reported(run: Callable[[], object]) -> int:
    """`run()` under torch's sync debug mode: the synchronisations it reports."""
    from h3lab.bench.sync_sites import under_sync_warnings

    count = 0

    def seen(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        nonlocal count
        count += _SYNC_WARNING in str(message)

    under_sync_warnings(run, seen)
    return count


class _HostReads(TorchDispatchMode):
    """Notes every op that reads a tensor on the host."""

    def __init__(self, note: Callable[[], None]) -> None:
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")  # "" for a higher-order op
        indices = args[1] if name == "index" and isinstance(args[1], list | tuple) else ()
        masked = any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices)
        if name.startswith(_HOST_READS) or masked:
            self.note()
        return func(*args, **(kwargs or {}))


def _noted(run: Callable[[], object], note: Callable[[], None]) -> None:
    """`run()` with `_HostReads` on, and `Tensor.tolist`, `Tensor.cpu` and the blocking copies naming a
    device noted."""

    def read(name: str) -> Callable[..., Any]:
        def reads(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            note()
            return originals[name](self, *args, **kwargs)

        return reads

    def to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        named = kwargs.get("device") is not None or any(isinstance(a, str | torch.device) for a in args)
        if named and not kwargs.get("non_blocking", False):
            note()
        return originals["to"](self, *args, **kwargs)

    def factory(name: str) -> Callable[..., Tensor]:
        def made(*args: Any, **kwargs: Any) -> Tensor:
            if kwargs.get("device") is not None:
                note()
            return originals[name](*args, **kwargs)

        return made

    owners = {"tolist": torch.Tensor, "cpu": torch.Tensor, "to": torch.Tensor, "tensor": torch, "as_tensor": torch}
    originals = {n: getattr(o, n) for n, o in owners.items()}
    own = {n: n in vars(o) for n, o in owners.items()}  # Tensor's methods live on its C base class
    patches = {"tolist": read("tolist"), "cpu": read("cpu"), "to": to} | {
        n: factory(n) for n in ("tensor", "as_tensor")
    }
    _COUNTER_CODE.update(f.__code__ for f in patches.values())
    try:
        for n, f in patches.items():
            setattr(owners[n], n, f)
        with _HostReads(note):
            run()
    finally:
        for n, o in owners.items():
            if own[n]:
                setattr(o, n, originals[n])
            else:
                delattr(o, n)


# the counter's own frames, never a site (torch wraps a mode's __torch_dispatch__)
_COUNTER_CODE = {
    inspect.unwrap(f).__code__ for f in (host_syncs, _site, _cuda_reported, _noted, _HostReads.__torch_dispatch__)
}


SIDES = {
    "parallelize_flow": parallelize_flow,
    "trainer": trainer,
    "eager": eager,
    "parallelize_custom": parallelize_custom,
}


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """The benchmark (or, with --worker, one of its ranks); a bad argument is one line, exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parse_args(argv)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if a.worker is not None:
        return worker(a.worker)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        record = bench(a, argv)
    except BaseException as err:  # the record ends failed or interrupted, never running
        status = "interrupted" if isinstance(err, KeyboardInterrupt | SystemExit) else "failed"
        write_json(a.out, json.loads(a.out.read_text()) | {"status": status, "error": f"{type(err).__name__}: {err}"})
        raise
    write_json(a.out, record | {"elapsed_s": time.perf_counter() - start})
    if record["status"] != "complete":
        print(f"{PROG}: {record['error']}", file=sys.stderr)
        return 1
    r, b, syncs = record["ratios"], record["bitwise"], record["host_syncs"]
    phases = {side: {p: round(s * 1e3, 2) for p, s in ph.items()} for side, ph in record["phases_median_s"].items()}
    print(
        f"parallelize_flow / trainer {r['parallelize_flow / trainer']:.3f} (target <= {TARGET}), "
        f"parallelize_flow / eager {r['parallelize_flow / eager']:.3f}; bitwise: {b}; {a.out}\n"
        f"phases, median ms: {phases}\nhost syncs per step: {syncs}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
