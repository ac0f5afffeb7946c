"""The layout runner: canonical block once, each layout on N processes, every byte compared.

Run directory (nothing in it claims completion until `summary.json` says so; it is rewritten
atomically with status "running" first and "passed" / "failed" last):
  request.json                      what was asked, the exact command
  env.json                          versions, devices, node type, git commit and dirty flag
  canonical.safetensors             out, dx, dtemb, dw.<parameter> of the single-process block
  layouts/<slug>/                   spec.json, per-rank logs, status, json and safetensors
  layouts/<slug>.safetensors        the layout's reassembled out, dx, dtemb and dw.<parameter>
  summary.json                      verdicts per layout and tensor, decisions, timings, failures
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from h3lab.comm import LocalComm
from h3lab.contract import describe
from h3lab.dist.layout import Layout
from h3lab.dist.seqshard import SeqShard
from h3lab.io.env import brief, capture
from h3lab.io.jsonfile import write_json
from h3lab.metrics import compare, sha256_tensor
from h3lab.run import tasks
from h3lab.run.launch import LaunchResult, launch
from h3lab.run.problem import Problem
from h3lab.run.summary import failure_line
from h3lab.run.trace import TraceRecorder, assemble_trace, first_divergence, load_trace, save_trace


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    layouts: tuple[Layout, ...]
    problem: Problem
    out: Path
    timeout_s: float = 600.0
    algorithm: str = "auto"
    agents: str = "one"  # "one" torchrun agent per layout, or "per-node": one per layout node on 127.0.0.1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    trace: bool = False  # record every op on every rank and name each layout's first divergence
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError("no layouts to run")
        if self.agents not in ("one", "per-node"):
            raise ValueError(f"agents={self.agents!r}; allowed: 'one', 'per-node'")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout {self.timeout_s} s must be positive")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (HOST:PORT of node 0)")
        config = self.problem.config()
        for layout in self.layouts:
            layout.check(config)
            if self.nnodes > 1 and layout.nodes != self.nnodes:
                raise ValueError(f"layout {layout.name} has {layout.nodes} nodes but the job has nnodes={self.nnodes}")


def slug(layout: Layout) -> str:
    """A file-safe name: tp8:2x4 -> tp8_2x4, tp4xcp2+sp -> tp4xcp2_sp."""
    return layout.name.replace(":", "_").replace("+", "_")


def prepare_run_dir(out: Path) -> None:
    """Create `out`; refuse one that holds anything (nothing is ever overwritten)."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"run directory {str(out)!r} exists and is not empty; choose a new --out")
    (out / "layouts").mkdir(parents=True, exist_ok=True)


def run(req: RunRequest) -> dict:
    """Run every layout of `req`; returns the summary (also written to `req.out/summary.json`)."""
    prepare_run_dir(req.out)
    started = time.time()
    request = {
        "layouts": [lay.name for lay in req.layouts],
        "problem": req.problem.to_dict(),
        "timeout_s": req.timeout_s,
        "algorithm": req.algorithm,
        "agents": req.agents,
        "nnodes": req.nnodes,
        "node_rank": req.node_rank,
        "rdzv_endpoint": req.rdzv_endpoint,
        "trace": req.trace,
        "command": shlex.join(req.command),
        "cwd": os.getcwd(),
    }
    write_json(req.out / "request.json", request)
    env = capture(req.problem.device)
    write_json(req.out / "env.json", env)  # versions, node type, git state
    summary: dict = {
        "status": "running",
        "started": started,
        "request": request,
        "contract": describe(),
        "environment": brief(env),
        "layouts": {},
    }
    write_json(req.out / "summary.json", summary)
    leader = req.node_rank == 0
    if leader:
        summary["canonical"] = _canonical(req)
    bar = tqdm(req.layouts, desc="layouts", unit="layout", disable=None, file=sys.stderr)
    try:
        for layout in bar:
            bar.set_postfix_str(layout.name)
            record = _run_layout(req, layout, leader)
            summary["layouts"][layout.name] = record
            write_json(req.out / "summary.json", summary)
            if record["status"] != "passed":
                tqdm.write(failure_line(layout.name, record), file=sys.stderr)
    except BaseException as err:  # Ctrl-C, SIGTERM (raised as SystemExit by the CLI), a bug: never "passed"
        summary |= {"status": "interrupted", "error": f"{type(err).__name__}: {err}", "finished": time.time()}
        write_json(req.out / "summary.json", summary)
        raise
    summary["status"] = "passed" if all(r["status"] == "passed" for r in summary["layouts"].values()) else "failed"
    summary["finished"] = time.time()
    summary["elapsed_s"] = summary["finished"] - started
    write_json(req.out / "summary.json", summary)
    return summary


def _canonical(req: RunRequest) -> dict:
    p = req.problem
    device = torch.device("cuda" if p.device == "cuda" else "cpu")
    t = time.perf_counter()
    result = tasks.canonical(p, device)
    elapsed, timings = time.perf_counter() - t, result.timings
    tensors = {k: v.contiguous().cpu() for k, v in result.tensors.items()}
    save_file(tensors, str(req.out / "canonical.safetensors"))
    if p.digests:
        write_json(req.out / "canonical.digests.json", result.digests)
    if req.trace:  # a second, traced pass: the finder compares every op of every layout with it
        recorder = TraceRecorder()
        tasks.compute(p, LocalComm(), device, trace=recorder)
        recorder.save(req.out / "canonical.trace")
    sha = {k: sha256_tensor(v) for k, v in tensors.items()}
    return {"time_s": elapsed, "timings": timings, "backend": p.block_backend, "sha256": sha}


def _run_layout(req: RunRequest, layout: Layout, leader: bool) -> dict:
    d = req.out / "layouts" / slug(layout)
    d.mkdir(parents=True, exist_ok=True)
    spec = {
        "layout": layout.name,
        "problem": req.problem.to_dict(),
        "algorithm": req.algorithm,
        "trace": req.trace,
        "layout_dir": str(d.resolve()),
        "canonical": str((req.out / "canonical.safetensors").resolve()),
    }
    write_json(d / "spec.json", spec)
    per_node = req.agents == "per-node" and req.rdzv_endpoint is None
    res = launch(
        "h3lab.run.workers.rank",
        [str((d / "spec.json").resolve())],
        nproc_per_node=layout.local if (per_node or req.nnodes > 1) else layout.world,
        log_dir=d,
        timeout_s=req.timeout_s,
        agents=layout.nodes if per_node else 1,
        nnodes=req.nnodes,
        node_rank=req.node_rank,
        rdzv_endpoint=req.rdzv_endpoint,
    )
    record: dict = {"world": layout.world, "launch": _launch_record(res)}
    if not res.ok:
        record |= {"status": "failed", "failure": diagnose(d, layout.world, res)}
        return record
    if not leader:
        return record | {"status": "passed", "note": "ranks of this node finished; node 0 assembles"}
    ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(layout.world)]
    num_rows = None if req.problem.task == "trajectory" else req.problem.batch().num_rows
    full, consistent = _assemble(d, layout, req.problem.config(), num_rows)
    canon = load_file(str(req.out / "canonical.safetensors"))
    save_file(full, str(req.out / "layouts" / f"{slug(layout)}.safetensors"))
    tensors = {k: compare(full[k], canon[k], name=k).to_dict() for k in canon}
    if req.problem.digests:  # every rank checked its digests; they must also agree across replicas
        canon_digests = json.loads((req.out / "canonical.digests.json").read_text())
        seen: dict[str, str] = {}
        for r in ranks:
            for k, v in r["digests"].items():
                consistent &= seen.setdefault(k, v) == v
        tensors |= {
            k: {"bitwise_equal": seen.get(k) == v, "sha256_a": seen.get(k), "sha256_b": v}
            for k, v in canon_digests.items()
        }
    ok = all(t["bitwise_equal"] for t in tensors.values()) and all(r["all_equal"] for r in ranks) and consistent
    record |= {
        "status": "passed" if ok else "mismatch",
        "ranks_all_equal": all(r["all_equal"] for r in ranks),
        "replicas_consistent": consistent,
        "tensors": tensors,
        "ranks": [
            {k: r.get(k) for k in ("rank", "coords", "units", "local_rows", "device", "transport", "timings")}
            for r in ranks
        ],
        "decisions": ranks[0]["decisions"],
    }
    if req.trace:
        trace, order = assemble_trace(d, layout, num_rows or 0)
        save_trace(req.out / "layouts" / f"{slug(layout)}.trace", trace, order)
        canon_trace, canon_order = load_trace(req.out / "canonical.trace")
        record["first_divergence"] = first_divergence(canon_trace, canon_order, trace)
    return record


def _assemble(d: Path, layout: Layout, config, num_rows: int | None) -> tuple[dict[str, torch.Tensor], bool]:
    """The full result from the ranks' shards (h3lab.run.tasks naming); checks that replicas agree byte for byte."""
    parts = [load_file(str(d / f"rank{r}.safetensors")) for r in range(layout.world)]
    shard = SeqShard(layout, num_rows) if num_rows else None
    consistent = True
    for r in range(layout.world):  # ranks holding the same rows or units must hold the same bytes
        for k, v in parts[r].items():
            if k in tasks.ROW_TENSORS:
                owner = next(o for o in shard.owner_ranks() if shard.local_rows(o) == shard.local_rows(r))
                ref = parts[owner][k]
            else:  # unit slices: the same TP index in CP group 0; replicated: rank 0
                ref = parts[layout.coords(r)[1]][k] if "@u" in k else parts[0][k]
            consistent &= compare(v, ref).bitwise_equal
    full = {k: v for k, v in parts[0].items() if k not in tasks.ROW_TENSORS and "@u" not in k}
    for t in range(layout.tp):  # the TP ranks of CP group 0 hold every unit once
        full |= {k: v for k, v in parts[t].items() if "@u" in k}
    full = tasks.assemble_units(full, config, units=range(8))
    for k in tasks.ROW_TENSORS:
        if k in parts[0]:
            full[k] = torch.cat([parts[o][k] for o in shard.owner_ranks()])[:num_rows]
    return full, consistent


def _launch_record(res: LaunchResult) -> dict:
    return {
        "returncode": res.returncode,
        "timed_out": res.timed_out,
        "elapsed_s": res.elapsed_s,
        "token": res.token,
        "commands": [shlex.join(c) for c in res.commands],
        "agent_logs": [str(p) for p in res.agent_logs],
        "killed_leftovers": res.killed_leftovers,
    }


def diagnose(d: Path, world: int, res: LaunchResult) -> dict:
    """Name the rank that failed first and why, from the ranks' status and heartbeat files.

    Every failed rank gets an event time: when it raised, or, for a rank that died without a word
    (SIGKILL, a crash, or a rank blocked in a collective that the agent had to kill), its last
    heartbeat. The earliest event is the root cause; the others are collateral. On a timeout the
    straggler is the rank with the fewest collective calls (the others wait for it inside one).
    """
    status, beat = {}, {}
    for r in range(world):
        p, hb = d / f"rank{r}.status.json", d / f"rank{r}.heartbeat"
        status[r] = _read(p, json.loads, {"state": "never started"})
        beat[r] = _read(hb, float, float("-inf"))
    states = {rank: s["state"] for rank, s in status.items()}
    log = lambda r: str(d / f"rank{r}.log")  # noqa: E731
    if res.timed_out:
        # the runner's kill after the timeout marks ranks "terminated"; their progress is what counts
        running = [r for r, s in status.items() if s["state"] in ("running", "never started", "terminated")]
        if running:
            r = min(running, key=lambda r: status[r].get("calls", -1))
            calls, site = status[r].get("calls", 0), status[r].get("site", "")
            reason = f"hung: still running after {res.elapsed_s:.0f} s, stuck after step {calls} ({site!r})"
            return {"rank": r, "reason": reason, "log": log(r), "states": states}
    events = []
    for r, s in status.items():
        if s["state"] == "error":
            events.append((s["time"], r, f"raised {s['error']}"))
        elif s["state"] in ("running", "never started"):
            events.append(
                (
                    beat[r],
                    r,
                    "killed: the process died without reporting (a signal such as SIGKILL, "
                    "a crash, or the agent stopping a rank blocked in a collective)",
                )
            )
    if not events:
        return {"rank": 0, "reason": f"torchrun exited with {res.returncode}", "log": log(0), "states": states}
    _, r, reason = min(events)
    return {"rank": r, "reason": reason, "log": log(r), "states": states}


def _read(path: Path, parse, default):
    """A rank's status or heartbeat file; a missing or half-written one (the rank died mid-write) is `default`."""
    try:
        return parse(path.read_text())
    except (OSError, ValueError):
        return default
