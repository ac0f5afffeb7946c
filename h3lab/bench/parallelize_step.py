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
(lr 1e-5) with a clip at 1. Two launches through h3lab.launch.launcher, each rank this module with `--worker`
(h3lab.bench.parallelize_sides):
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
counts its host synchronisations by site (h3lab.bench.host_syncs); the record holds the sites where
`parallelize_flow` makes more than `trainer` (the target: none). Bitwise: tp2's `parallelize_custom`
against tp1's on both ranks; `parallelize_flow` against `trainer` (the loss, the norm, every weight
after step 2). The record is written at the start (`running`) and at the end (`complete`, or `failed`
with the launch that failed and its logs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

from h3lab.bench.parallelize_sides import LR, MAX_NORM, worker
from h3lab.config import NAMED_CONFIGS, H3Config
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.launch.launcher import launch
from h3lab.model.packing import min_request_rows
from h3lab.parallel.layout import Layout

BENCH_FORMAT = "h3lab-bench-parallelize-step-v1"
PROG = "python -m h3lab.bench.parallelize_step"
LAYOUTS = ("tp1", "tp2")
TARGET = 1.03  # parallelize_flow / trainer, medians
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
