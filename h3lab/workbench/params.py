"""The notebooks' parameters as validated records: a bad value stops the first cell with one clear line.

Each notebook's `parameters` cell holds flat scalars and lists (papermill injects overrides after
it); the next cell builds one of these records, whose `__post_init__` raises `ValueError` naming
the parameter, the value and what is allowed. Paths are made absolute here, because a notebook's
kernel runs in the notebook's folder while `make` runs in the repository root.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3lab.parallel.layout import ALL_LAYOUTS, Layout, parse_layouts
from h3lab.run.compare import CompareRequest
from h3lab.run.problem import MODES, Problem

TENSOR_NAMES = ("out", "dx", "dtemb")  # plus every "dw.<parameter>" of the block
WEIGHTS_SEED = 0  # synthetic checkpoints always use weight seed 0: seeds vary the batch, not the block


def runs_root() -> Path:
    """Where new run directories go: $H3LAB_RUNS, else runs/ of the enclosing h3lab checkout, else ./runs."""
    if os.environ.get("H3LAB_RUNS"):
        return Path(os.environ["H3LAB_RUNS"]).resolve()
    for d in (Path.cwd(), *Path.cwd().parents):  # a kernel started in notebooks/ still finds the repo's runs/
        if (d / "pyproject.toml").is_file() and (d / "h3lab").is_dir():
            return d / "runs"
    return Path.cwd() / "runs"


def _names(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value) if v]
    if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"parameter {what}={value!r}; allowed: a non-empty list of names or a comma-separated string")
    return list(value)


def _path(value: str | os.PathLike | None) -> Path | None:
    return Path(value).expanduser().resolve() if value not in (None, "") else None


def block_range(blocks: str) -> tuple[int, int]:
    """ "A-B" (or "A") as (A, B); ValueError naming the value otherwise."""
    first, sep, last = str(blocks).partition("-")
    if not (first.isdigit() and (not sep or last.isdigit()) and int(first) <= int(last or first)):
        raise ValueError(f"parameter blocks={blocks!r}; allowed: '' or 'A-B' with A <= B, e.g. '0-49', or 'A'")
    return int(first), int(last or first)


def _check_gpus(gpus: Any, device: str) -> int:
    """The GPUs a sweep's processes run on: 0 on a CPU sweep; 1..(GPUs torch sees) on CUDA, 0 meaning all."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise ValueError(f"parameter gpus={gpus!r}; allowed: an int >= 0 (0: every GPU torch sees)")
    if device != "cuda":
        if gpus:
            raise ValueError(f"parameter gpus={gpus} with device={device!r}; allowed: 0 (CPU ranks)")
        return 0
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not seen:
        raise ValueError("parameter device='cuda' but torch sees no CUDA device; allowed here: ['cpu']")
    if gpus > seen:
        raise ValueError(f"parameter gpus={gpus} but torch sees {seen} CUDA devices; allowed: 0..{seen}")
    return gpus or seen


@dataclass(frozen=True, kw_only=True)
class ReproduceParams:
    """The layout sweep: every layout, in every mode and seed, on one block (notebooks/reproduce.py)."""

    device: str = "cpu"
    layouts: list[str] | str = "all"
    checkpoint: str | Path | None = None  # a diffusers checkpoint folder; None/"" synthesizes `config`
    config: str = "tiny"
    block: int = 0
    rows: int = 264
    seeds: list[int] | int = field(default_factory=lambda: [0])
    modes: list[str] | str = field(default_factory=lambda: list(MODES))
    backend: str = "torch"
    repeats: int = 1
    timeout: float = 600.0
    accuracy: bool = True
    trace: bool = False  # record every op (h3lab.run.trace): the explore notebook's first-divergence timeline
    gpus: int = 0  # cuda: the layouts' processes run on the first `gpus` GPUs (0: every GPU torch sees)
    digests: bool = False  # weight gradients compared by digests of unit slices, not stored (real shapes)
    blocks: str = ""  # "A-B": a chain of blocks A..B (dX at its input, every block's dW); "": the one `block`
    trajectory: int = 0  # > 0: that many sampler steps through the whole model with blocks `blocks`
    train_steps: int = 0  # > 0: that many training steps of blocks `blocks` with the embedders and heads
    run_dir: str | Path | None = None

    def __post_init__(self) -> None:
        """The sweep's own parameters here; every value of the runs it makes, by building their Problems
        (`Problem.validate`, the one validator of a run request that `h3lab run` calls too)."""
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        fix("gpus", _check_gpus(self.gpus, self.device))
        for name in ("digests", "accuracy", "trace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"parameter {name}={getattr(self, name)!r}; allowed: true or false")
        if not isinstance(self.trajectory, int) or isinstance(self.trajectory, bool) or self.trajectory < 0:
            raise ValueError(f"parameter trajectory={self.trajectory!r}; allowed: 0 or a number of sampler steps >= 1")
        if not isinstance(self.train_steps, int) or isinstance(self.train_steps, bool) or self.train_steps < 0:
            raise ValueError(
                f"parameter train_steps={self.train_steps!r}; allowed: 0 or a number of training steps >= 1"
            )
        if self.trajectory and self.train_steps:
            raise ValueError(
                f"parameters trajectory={self.trajectory} and train_steps={self.train_steps}; allowed: one of them"
            )
        if self.train_steps and "baseline" in _names(self.modes, "modes"):
            raise ValueError("parameter modes: 'baseline' with train_steps; allowed: ['deterministic']")
        fix("blocks", "-".join(map(str, block_range(self.blocks))) if self.blocks not in ("", None) else "")
        if self.train_steps and not self.blocks:
            raise ValueError(f"parameter train_steps={self.train_steps} without blocks; allowed: blocks 'A-B'")
        try:
            layouts = parse_layouts(_names(self.layouts, "layouts"))
        except ValueError as err:
            raise ValueError(f"parameter layouts={self.layouts!r}: {err}") from None
        fix("layouts", [lay.name for lay in layouts])
        fix("modes", _names(self.modes, "modes"))
        seeds = [self.seeds] if isinstance(self.seeds, int) else self.seeds
        if not isinstance(seeds, list | tuple) or not seeds:
            raise ValueError(f"parameter seeds={self.seeds!r}; allowed: an int or a non-empty list of ints")
        fix("seeds", list(seeds))
        if not isinstance(self.timeout, int | float) or not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"parameter timeout={self.timeout!r}; allowed: a finite number of seconds > 0")
        fix("checkpoint", _path(self.checkpoint))
        fix("run_dir", _path(self.run_dir))
        if self.checkpoint is not None and not self.checkpoint.exists():
            raise ValueError(
                f"parameter checkpoint={str(self.checkpoint)!r} does not exist; allowed: a "
                "diffusers checkpoint folder (holding config.json) or '' to synthesize one"
            )
        self.problems(layouts)

    def problems(self, layouts: list[Layout] | None = None) -> list[Problem]:
        """The Problem of every (mode, seed) the sweep runs, each validated as it is built, and each
        layout checked against it (e.g. heads not divisible by tp: caught here, not after minutes of
        sweeping). A refusal names the parameter's value: `parameters: <Problem's message>`."""
        fields = self.to_dict()
        record = fields | {"task": self.task, "checkpoint_path": fields["checkpoint"]}
        out = []
        try:
            for mode in self.modes:
                for seed in self.seeds:
                    out.append(sweep_problem(record, mode, seed))
            for lay in layouts or []:
                out[0].check_layout(lay)
        except ValueError as err:
            raise ValueError(f"parameters: {err}") from None
        return out

    @property
    def task(self) -> str:
        """block, chain (blocks A-B), trajectory (sampler steps through blocks A-B) or train (training
        steps of blocks A-B), as h3lab.run.problem."""
        if self.train_steps:
            return "train"
        return "trajectory" if self.trajectory else "chain" if self.blocks else "block"

    def to_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True, kw_only=True)
class ExploreParams:
    """One layout of one run, interactively (notebooks/explore.py). Without run_dir, it runs the layout now."""

    run_dir: str | Path | None = None
    layout: str = "tp4xcp2+sp"
    mode: str = ""  # "": baseline when the run has it (where bits move), else the run's mode
    seed: int = 0
    tensor: str = "out"
    config: str = "tiny"
    rows: int = 64
    device: str = "cpu"
    timeout: float = 600.0
    trace: bool = True  # a fresh run records every op, for the first-divergence timeline
    # the key numbers' JSON: a new file; None: inside a fresh run's folder, none for a given run_dir
    # (a run explored is read, never written)
    record: str | Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", _path(self.run_dir))
        object.__setattr__(self, "record", _path(self.record))
        if self.record is not None and os.path.lexists(self.record):
            raise ValueError(f"parameter record={str(self.record)!r} exists; allowed: a new path ('' for none)")
        if self.run_dir is not None and not self.run_dir.is_dir():
            raise ValueError(
                f"parameter run_dir={str(self.run_dir)!r} is not a folder; allowed: a run directory "
                "(runs/<id>, or an `h3lab run --out` folder) or '' to run the layout now"
            )
        try:
            object.__setattr__(self, "layout", Layout.parse(self.layout).name)
        except ValueError as err:
            raise ValueError(f"parameter layout={self.layout!r}: {err}") from None
        if self.mode == "":
            object.__setattr__(self, "mode", self._default_mode())
        if self.mode not in MODES:
            raise ValueError(f"parameter mode={self.mode!r}; allowed: {list(MODES)} or '' (the run's)")
        if self.tensor not in TENSOR_NAMES and not self.tensor.startswith("dw."):
            raise ValueError(f"parameter tensor={self.tensor!r}; allowed: {list(TENSOR_NAMES)} or 'dw.<parameter>'")
        if self.run_dir is None:  # the fresh run's parameters go through the sweep's checks
            self.sweep_params(Path("unused"))
        else:  # the run must hold this mode, seed and layout (each raises naming what it holds)
            from h3lab.workbench.rundata import load_sweep

            load_sweep(self.run_dir).run(self.mode, self.seed).record(self.layout)

    def _default_mode(self) -> str:
        if self.run_dir is None:
            return "baseline"
        from h3lab.workbench.rundata import load_sweep

        modes = [r.mode for r in load_sweep(self.run_dir).runs]
        return "baseline" if "baseline" in modes or not modes else modes[0]

    def sweep_params(self, run_dir: Path) -> ReproduceParams:
        """The one-layout, one-mode sweep that explore runs when no run_dir is given."""
        return ReproduceParams(
            device=self.device,
            layouts=[self.layout],
            config=self.config,
            rows=self.rows,
            seeds=[self.seed],
            modes=[self.mode],
            timeout=self.timeout,
            accuracy=False,
            run_dir=run_dir,
            trace=self.trace,
        )


@dataclass(frozen=True, kw_only=True)
class ReportParams:
    """One or more run directories -> one report (notebooks/report.py)."""

    runs: list[str] | str = field(default_factory=list)
    title: str = "h3lab layout sweep"
    element_layout: str = ""  # the per-element map's layout; "" takes the sweep's last layout
    element_tensor: str = "out"
    fp64: bool = True  # the per-element error against the FP64 oracle (about 10 GB for a real block)
    out_dir: str | Path | None = None  # where the report's figures and report.json go
    benchmarks: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> {path, command, what}
    note: str = ""  # markdown under the title: where the runs come from when their records do not say

    def __post_init__(self) -> None:
        if not isinstance(self.benchmarks, dict):
            raise ValueError(f"parameter benchmarks={self.benchmarks!r}; allowed: a mapping name -> record")
        for name, entry in self.benchmarks.items():
            path = entry.get("path") if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or not (entry.get("skipped") or (path and Path(path).is_file())):
                raise ValueError(
                    f"parameter benchmarks[{name!r}]={entry!r}; allowed: {{'path': an existing JSON record, "
                    "'command': ..., 'what': ...}} or {'skipped': the reason}"
                )
        runs = [self.runs] if isinstance(self.runs, str | Path) else list(self.runs)
        if not runs:
            raise ValueError("parameter runs=[]; allowed: one or more run directories (runs/<id>)")
        paths = [_path(r) for r in runs]
        for p, raw in zip(paths, runs, strict=True):
            if p is None or not p.is_dir():
                raise ValueError(f"parameter runs: {str(raw)!r} is not a folder; allowed: run directories (runs/<id>)")
        object.__setattr__(self, "runs", paths)
        object.__setattr__(self, "out_dir", _path(self.out_dir))
        if self.element_layout:
            try:
                object.__setattr__(self, "element_layout", Layout.parse(self.element_layout).name)
            except ValueError as err:
                raise ValueError(f"parameter element_layout={self.element_layout!r}: {err}") from None
        if self.element_tensor not in TENSOR_NAMES and not self.element_tensor.startswith("dw."):
            raise ValueError(
                f"parameter element_tensor={self.element_tensor!r}; allowed: {list(TENSOR_NAMES)} or 'dw.<parameter>'"
            )


def sweep_problem(params: dict[str, Any], mode: str, seed: int, *, task: str | None = None) -> Problem:
    """The runner's Problem for one (mode, seed) of a sweep's params.json (`task` overrides its task)."""
    task = task or params.get("task", "block")
    first, last = block_range(params["blocks"]) if params.get("blocks") else (params["block"], None)
    checkpoint = params.get("checkpoint_path")
    return Problem(
        synthetic=None if checkpoint else params["config"],
        checkpoint=checkpoint,
        task=task,
        block=first,
        last_block=last if task != "block" else None,
        steps=params.get("trajectory") or params.get("train_steps") or 2,
        weights_seed=WEIGHTS_SEED,
        rows=params["rows"],
        seed=seed,
        device=params["device"],
        backend=params["backend"],
        mode=mode,
        repeats=params["repeats"],
        digests=params.get("digests", False),
    )


EXAMPLE_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "my_train.py"  # the checkout's example


@dataclass(frozen=True, kw_only=True)
class YourCodeParams:
    """Your own script under layouts against one process (notebooks/your_code.py, `h3lab compare`)."""

    layouts: list[str] | str = field(default_factory=lambda: ["tp2", "tp4xcp2+sp"])
    steps: int = 2  # the script's --steps
    script: str | Path | None = None  # a `python SCRIPT` training script; None/"" takes examples/my_train.py
    run_dir: str | Path | None = None  # the compare run's folder, new or empty; None/"": runs/<time>-your-code-<hex>
    timeout: float = 600.0  # seconds per launch: the tp1 reference, each layout

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "layouts", [lay.name for lay in parse_layouts(_names(self.layouts, "layouts"))])
        except ValueError as err:
            raise ValueError(f"parameter layouts={self.layouts!r}: {err}") from None
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"parameter steps={self.steps!r}; allowed: an int >= 1")
        script = _path(self.script) or EXAMPLE_SCRIPT
        if not script.is_file():
            raise ValueError(f"parameter script={str(script)!r} is not a file; allowed: a Python training script")
        object.__setattr__(self, "script", script)
        run_dir = _path(self.run_dir)
        if run_dir is None:
            run_dir = runs_root() / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-your-code-{secrets.token_hex(2)}"
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise ValueError(f"parameter run_dir={str(run_dir)!r} is not a new or empty folder; allowed: one that is")
        object.__setattr__(self, "run_dir", run_dir)
        if not (isinstance(self.timeout, int | float) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"parameter timeout={self.timeout!r}; allowed: a finite number of seconds > 0")

    def request(self) -> CompareRequest:
        """The compare run: `python SCRIPT --steps N` under every layout (what `h3lab compare` runs after `--`)."""
        command = ("python", str(self.script), "--steps", str(self.steps))
        layouts = tuple(Layout.parse(name) for name in self.layouts)
        return CompareRequest(layouts=layouts, command=command, out=self.run_dir, timeout_s=self.timeout)


__all__ = [
    "ALL_LAYOUTS",
    "WEIGHTS_SEED",
    "ExploreParams",
    "ReportParams",
    "ReproduceParams",
    "YourCodeParams",
    "block_range",
    "runs_root",
    "sweep_problem",
]
