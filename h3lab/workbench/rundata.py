"""Reading run directories back: a sweep (runs/<id>/) or a single `h3lab run` directory.

A sweep holds env.json, params.json, one runner directory per mode and seed (<mode>/seed<s>/, each
with the runner's summary.json, canonical.safetensors and layouts/) and, written last, sweep.json.
A bare runner directory (`h3lab run --out DIR`) reads as a sweep of one mode and seed; its node
type then comes from the runner's own environment record. A run whose record still says "running"
while the process that wrote it is gone reads as "stale" (h3lab.io.rundir).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from h3lab.io.env import KNOWN_GPUS
from h3lab.io.rundir import describe_status, effective_status
from h3lab.parallel.layout import Layout
from h3lab.run.problem import Problem
from h3lab.run.runner import slug
from h3lab.run.trace import load_trace, timeline


@dataclass(frozen=True)
class RunnerRun:
    """One `h3lab.run.runner.run` directory: every layout of one mode and one batch seed."""

    path: Path
    summary: dict[str, Any]

    @property
    def mode(self) -> str:
        return self.summary["request"]["problem"]["mode"]

    @property
    def seed(self) -> int:
        return self.summary["request"]["problem"]["seed"]

    @property
    def layouts(self) -> list[str]:
        return list(self.summary["layouts"])

    @property
    def problem_label(self) -> str:
        """What was compared, in words: 'block 0, 264 rows, synthetic real', 'blocks 0-49, 264 rows,
        checkpoint of the tiny config', 'trajectory of 2 steps, blocks 0-3, synthetic tiny', 'training,
        2 steps, blocks 0-3, synthetic tiny' (the report groups its tables and figures by it)."""
        p = self.summary["request"]["problem"]
        weights = f"synthetic {p['synthetic']}" if p.get("synthetic") else _checkpoint_label(p["checkpoint"])
        blocks = f"blocks {p['block']}-{p.get('last_block')}"
        task = p.get("task", "block")
        if task == "trajectory":
            return f"trajectory of {p.get('steps')} steps, {blocks}, {weights}"
        if task == "train":
            steps = p.get("steps")
            return f"training, {steps} step{'' if steps == 1 else 's'}, {blocks}, {weights}"
        return f"{blocks if task == 'chain' else 'block ' + str(p['block'])}, {p['rows']} rows, {weights}"

    @property
    def status(self) -> str:
        """passed, failed, interrupted, running, or stale (running, its runner gone)."""
        return effective_status(self.summary)

    @property
    def tensor_names(self) -> list[str]:
        """out, dx, dtemb, then the dW in the block's parameter order (the canonical result's order).

        A digests run (`h3lab run --digests`) stores out and dx and digests of the rest per unit slice.
        """
        names = list(self.summary.get("canonical", {}).get("sha256", {}))
        digests = self.path / "canonical.digests.json"
        if digests.is_file():
            names += [k for k in json.loads(digests.read_text()) if k not in names]
        return names

    def problem(self) -> Problem:
        """The run's block and batch; a CUDA run read on a machine without CUDA rebuilds them on the CPU."""
        raw = dict(self.summary["request"]["problem"])
        if raw["device"] == "cuda" and not torch.cuda.is_available():
            raw["device"] = "cpu"
        return Problem.from_dict(raw)

    def record(self, layout: str) -> dict[str, Any]:
        if layout not in self.summary["layouts"]:
            raise ValueError(f"layout {layout!r} is not in run {str(self.path)!r}; allowed: {self.layouts}")
        return self.summary["layouts"][layout]

    def _layout_path(self, layout: str, suffix: str = "") -> Path:
        """The runner's file (or folder, without suffix) of a layout in this run directory."""
        return self.path / "layouts" / f"{slug(Layout.parse(layout))}{suffix}"

    def has_tensors(self, layout: str) -> bool:
        """Whether the layout's and the canonical tensors are on disk (real-size runs may keep digests only)."""
        return self._layout_path(layout, ".safetensors").is_file() and (self.path / "canonical.safetensors").is_file()

    def tensors(self, layout: str) -> dict[str, Tensor]:
        """The layout's reassembled out, dx, dtemb and dw.<parameter> (raises if the layout failed)."""
        path = self._layout_path(layout, ".safetensors")
        if not path.is_file():
            raise ValueError(f"layout {layout!r} left no result ({self.record(layout)['status']}): {str(path)!r}")
        return load_file(str(path))

    def canonical(self) -> dict[str, Tensor]:
        return load_file(str(self.path / "canonical.safetensors"))

    def divergence(self, layout: str) -> list[dict[str, Any]] | None:
        """The layout's op-by-op comparison with the single process (h3lab.run.trace.timeline); None untraced."""
        prefix = self._layout_path(layout, ".trace")
        if not (self.path / "canonical.trace.json").is_file() or not Path(f"{prefix}.json").is_file():
            return None
        canon, order = load_trace(self.path / "canonical.trace")
        return timeline(canon, order, load_trace(prefix)[0])

    def rank_records(self, layout: str) -> list[dict[str, Any]]:
        """Every rank's own record (timings, its collective decisions); the summary keeps rank 0's decisions only."""
        rec = self.record(layout)
        d = self._layout_path(layout)
        out = []
        for r, summary_rank in enumerate(rec.get("ranks", [])):
            p = d / f"rank{r}.json"
            out.append(json.loads(p.read_text()) if p.is_file() else summary_rank | {"decisions": []})
        if out and not out[0]["decisions"]:
            out[0]["decisions"] = rec.get("decisions", [])
        return out


@dataclass(frozen=True)
class Sweep:
    """A run directory as the notebooks and the report read it."""

    path: Path
    env: dict[str, Any]
    params: dict[str, Any]
    runs: list[RunnerRun]
    record: dict[str, Any] = field(default_factory=dict)  # sweep.json; {} while running or for a bare runner dir

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def node_type(self) -> str:
        return self.env.get("node_type", "unknown")

    @property
    def status(self) -> str:
        """passed or failed when finished; else running, interrupted, stale or incomplete."""
        return effective_status(self.record) if self.record else "incomplete"

    def require_complete(self) -> None:
        """Raise unless the sweep and every run in it finished (passed or failed) with a canonical result.

        Raises:
            ValueError: one line naming the run and its state (running, interrupted, stale, ...).
        """
        if self.status not in ("passed", "failed"):
            state = describe_status(self.record, self.path) if self.record else f"{str(self.path)!r} is incomplete"
            raise ValueError(f"this run cannot be reported: {state}; allowed: a finished run (passed or failed)")
        for run in self.runs:
            canonical = run.summary.get("canonical") or {}
            if run.status not in ("passed", "failed") or canonical.get("status", "done") != "done":
                why = describe_status(run.summary, run.path)
                if canonical.get("status") == "failed":
                    why = f"{str(run.path)!r} has no canonical result: {canonical['failure']['reason']}"
                raise ValueError(f"this run cannot be reported: {why}; allowed: a finished run (passed or failed)")

    @cached_property
    def accuracy(self) -> dict[str, Any] | None:
        p = self.path / "accuracy.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def run(self, mode: str, seed: int | None = None) -> RunnerRun:
        """The runner directory of `mode` (and `seed`; None takes the first)."""
        found = [r for r in self.runs if r.mode == mode and (seed is None or r.seed == seed)]
        if not found:
            have = [(r.mode, r.seed) for r in self.runs]
            raise ValueError(f"no run of mode={mode!r} seed={seed!r} in {str(self.path)!r}; allowed: {have}")
        return found[0]


def load_sweep(path: str | Path) -> Sweep:
    """A sweep directory, or a bare runner directory read as a sweep of one run.

    Raises:
        ValueError: the folder holds neither params.json nor a runner's summary.json.
    """
    path = Path(path).resolve()
    if (path / "params.json").is_file():
        params = json.loads((path / "params.json").read_text())
        found = [path / m / f"seed{s}" / "summary.json" for m in params["modes"] for s in params["seeds"]]
        runs = [RunnerRun(p.parent, json.loads(p.read_text())) for p in found if p.is_file()]  # in sweep order
        env = json.loads((path / "env.json").read_text()) if (path / "env.json").is_file() else {}
        sweep_json = path / "sweep.json"
        record = json.loads(sweep_json.read_text()) if sweep_json.is_file() else {}
        return Sweep(path, env, params, runs, record)
    if (path / "summary.json").is_file():
        summary = json.loads((path / "summary.json").read_text())
        env = json.loads((path / "env.json").read_text()) if (path / "env.json").is_file() else {}
        env = env or {**summary.get("environment", {}), "node_type": _node_type(summary.get("environment", {}))}
        record = {k: summary[k] for k in ("status", "owner", "error") if k in summary}
        params = {"problem": summary["request"]["problem"]} | (
            {"started": summary["started"]} if "started" in summary else {}
        )
        return Sweep(path, env, params, [RunnerRun(path, summary)], record)
    raise ValueError(f"{str(path)!r} is not a run directory; allowed: a sweep (params.json) or an `h3lab run` folder")


def _checkpoint_label(path: str) -> str:
    """'checkpoint of the tiny config' when its config.json is a named config's shapes (any number of
    blocks: a sweep writes the blocks it needs), else 'checkpoint <folder>'."""
    from h3lab.config import NAMED_CONFIGS, H3Config
    from h3lab.io.manifest import find_layout

    try:
        config = H3Config.from_json(find_layout(path).folder)
    except (OSError, ValueError):  # a record read where its checkpoint is not
        return f"checkpoint {Path(path).name}"
    named = [n for n in NAMED_CONFIGS if H3Config.named(n).replace(num_layers=config.num_layers) == config]
    return f"checkpoint of the {named[0]} config" if named else f"checkpoint {Path(path).name}"


def _node_type(environment: dict[str, Any]) -> str:
    gpu = environment.get("gpu")
    if not gpu:
        return "CPU"
    known = [k for k in KNOWN_GPUS if k in gpu.upper()]
    return known[0] if known else "unknown-" + re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")


def oracle_tensors(run: RunnerRun) -> dict[str, Tensor]:
    """The FP64 oracle's out, dx, dtemb and dw.<parameter> for the run's block and batch (float64).

    The oracle is of one block: a chain or trajectory run gets {} (no FP64 comparison).
    """
    from h3lab.reference.oracle import oracle_block

    problem = run.problem()
    if problem.task != "block":
        return {}
    result = oracle_block(problem.weights(problem.device), problem.batch(problem.device)).tensors()
    return {k: v.detach().cpu() for k, v in result.items()}
