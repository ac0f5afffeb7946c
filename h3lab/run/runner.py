"""The layout runner: canonical block once, each layout on N processes, every byte compared.

Run directory (claimed exclusively, h3lab.io.rundir; nothing in it claims completion until
`summary.json` says so; it is rewritten atomically with status "running" first and "passed",
"failed" or "interrupted" last, whatever ends the run short of a SIGKILL of the runner, which
leaves "running" with a dead owner: readers call that "stale"):
  owner.json                        the claim: host, pid and start time of the runner, its token
  request.json                      what was asked, the exact command
  env.json                          versions, devices, node type, git commit and dirty flag
  canonical.log, canonical.*.json   the canonical process: its output, status and record
  canonical.safetensors             out, dx, dtemb, dw.<parameter> of the single-process block
  layouts/<slug>/                   spec.json, per-rank logs, status, json and safetensors
  layouts/<slug>.safetensors        the layout's reassembled out, dx, dtemb and dw.<parameter>
  summary.json                      verdicts per layout and tensor (and per training step), decisions,
                                    timings, failures
  nodes/node<R>/                    node R > 0 of a multi-node run: its own owner, request, env, summary

The canonical result runs in a process of its own (h3lab.run.workers.canonical) under the same
`--timeout` as a layout, so a hang, a crash or a full disk there ends the run with a status, and
Ctrl-C stops it like a layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from h3lab.contract import NUM_UNITS, describe
from h3lab.io.env import brief, capture
from h3lab.io.jsonfile import write_json
from h3lab.io.rundir import FINAL_STATES, claim, describe_end, read_record, reserve_space, write_final
from h3lab.io.tensorfile import write_tensors
from h3lab.launch.launcher import (
    LaunchResult,
    check_local_processes,
    launch,
    launch_process,
    new_token,
    split_endpoint,
)
from h3lab.metrics import compare
from h3lab.parallel.assemble import full_tensors, replicas_agree
from h3lab.parallel.layout import Layout
from h3lab.run import tasks
from h3lab.run.diagnose import diagnose
from h3lab.run.limits import check_request
from h3lab.run.problem import Problem
from h3lab.run.steps import step_verdicts
from h3lab.run.summary import failure_line
from h3lab.run.trace import assemble_trace, first_divergence, load_trace, save_trace

POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    layouts: tuple[Layout, ...]
    problem: Problem
    out: Path
    timeout_s: float = 600.0  # each phase: the canonical process, and each layout's launch
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
        if not isinstance(self.timeout_s, int | float) or not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout {self.timeout_s!r} s; allowed: a finite number of seconds > 0")
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"nnodes={self.nnodes!r}; allowed: an int >= 1")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank!r}; allowed: 0..{self.nnodes - 1} for nnodes={self.nnodes}")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (HOST:PORT of node 0)")
        if self.rdzv_endpoint is not None:
            split_endpoint(self.rdzv_endpoint)
        # the request's upper bounds (memory, blocks, repeats): here, where a run is asked for, and not in
        # Problem, which module constants (h3lab.run.golden) and every worker build on any machine
        check_request(self.problem)
        for layout in self.layouts:
            self.problem.check_layout(layout)
            if self.nnodes > 1 and layout.nodes != self.nnodes:
                raise ValueError(f"layout {layout.name} has {layout.nodes} nodes but the job has nnodes={self.nnodes}")
            try:  # what this machine starts: the whole layout, or this node's share
                check_local_processes(layout.local if self.nnodes > 1 else layout.world)
            except ValueError as err:
                raise ValueError(f"layout {layout.name}: {err}") from None

    @property
    def leader(self) -> bool:
        """Node 0: it computes the canonical result and assembles and compares every layout."""
        return self.node_rank == 0

    @property
    def home(self) -> Path:
        """This node's folder: the run folder on node 0, `nodes/node<R>/` inside it on node R."""
        return self.out if self.leader else self.out / "nodes" / f"node{self.node_rank}"


def slug(layout: Layout) -> str:
    """A file-safe name: tp8:2x4 -> tp8_2x4, tp4xcp2+sp -> tp4xcp2_sp."""
    return layout.name.replace(":", "_").replace("+", "_")


def run(req: RunRequest) -> dict:
    """Run every layout of `req`; returns the summary (also written to `req.home/summary.json`).

    Raises:
        ValueError: the run folder cannot be claimed (not empty, a file, unwritable, taken), or a
            node R > 0 finds no run of node 0 to join. Nothing is written then.
        Whatever interrupted the run (KeyboardInterrupt, SystemExit from SIGTERM) or broke it (a
            full disk, a bug), after summary.json says "interrupted" or "failed" with the error.
    """
    token = new_token()
    leader_token = token if req.leader else _join(req)
    owner = claim(req.home, token=token, node_rank=req.node_rank)
    summary = {
        "status": "running",
        "started": owner["started"],
        "owner": owner,
        "request": _request(req),
        "layouts": {},
    }
    write_json(req.home / "summary.json", summary)
    try:
        summary = _start(req, summary)
        reserve_space(req.home)  # given back for the final summary on a full disk
        canonical = _canonical(req, token) if req.leader else _await_canonical(req)
        summary["canonical"] = canonical
        if canonical["status"] != "done":
            return _finish(req, summary, "failed", canonical["failure"]["reason"])
        write_json(req.home / "summary.json", summary)
        bar = tqdm(req.layouts, desc="layouts", unit="layout", disable=None, file=sys.stderr)
        for layout in bar:
            bar.set_postfix_str(layout.name)
            record = _run_layout(req, layout, token, f"{leader_token}.{slug(layout)}")
            summary["layouts"][layout.name] = record
            write_json(req.home / "summary.json", summary)
            if record["status"] != "passed":
                tqdm.write(failure_line(layout.name, record), file=sys.stderr)
    except (KeyboardInterrupt, SystemExit) as err:  # Ctrl-C; SIGTERM and SIGHUP (SystemExit from the CLI)
        _finish(req, summary, "interrupted", describe_end(err))
        raise
    except BaseException as err:  # a full disk, a bug: never "passed", never left "running"
        _finish(req, summary, "failed", describe_end(err))
        raise
    passed = all(r["status"] == "passed" for r in summary["layouts"].values())
    return _finish(req, summary, "passed" if passed else "failed", None)


def _request(req: RunRequest) -> dict:
    return {
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


def _start(req: RunRequest, summary: dict) -> dict:
    """request.json, env.json and the whole "running" summary.json in this node's folder."""
    write_json(req.home / "request.json", summary["request"])
    env = capture(req.problem.device)
    write_json(req.home / "env.json", env)  # versions, node type, git state
    summary = summary | {
        "contract": describe(),
        "environment": brief(env),
        "checkpoint": req.problem.checkpoint_record(),
    }
    write_json(req.home / "summary.json", summary)
    return summary


def _finish(req: RunRequest, summary: dict, status: str, error: str | None) -> dict:
    """The final summary.json (h3lab.io.rundir.write_final: the reserve makes room on a full disk)."""
    assert status in FINAL_STATES, status
    summary |= {"status": status, "finished": time.time()}
    summary["elapsed_s"] = summary["finished"] - summary["started"]
    if error is not None:
        summary["error"] = error
    write_final(req.home / "summary.json", summary)
    return summary


def _canonical(req: RunRequest, token: str) -> dict:
    """The canonical result, from its own process (h3lab.run.workers.canonical) bounded by the timeout."""
    spec = {"problem": req.problem.to_dict(), "out": str(req.out.resolve()), "trace": req.trace}
    write_json(req.out / "canonical.spec.json", spec)
    res = launch_process(
        "h3lab.run.workers.canonical",
        [str((req.out / "canonical.spec.json").resolve())],
        log=req.out / "canonical.log",
        timeout_s=req.timeout_s,
        token=token,
    )
    record = read_record(req.out / "canonical.json")
    if res.ok and record is not None:
        return record | {"launch": _launch_record(res)}
    status = read_record(req.out / "canonical.status.json") or {"state": "never started"}
    if res.timed_out:
        reason = f"canonical process hung: still running after {res.elapsed_s:.0f} s (--timeout {req.timeout_s:g})"
    elif status["state"] == "error":
        reason = f"canonical process raised {status['error']}"
    else:
        reason = (
            f"canonical process exited with {res.returncode} without reporting (state {status['state']!r}: "
            "killed, out of memory, or a full disk)"
        )
    failure = {"rank": None, "reason": reason, "log": str(req.out / "canonical.log")}
    return {"status": "failed", "failure": failure, "launch": _launch_record(res)}


def _join(req: RunRequest) -> str:
    """Node R > 0: wait (up to the timeout) for node 0's claim of the shared run folder; its token.

    Raises:
        ValueError: no running run of node 0 with this endpoint and node count appeared in time.
    """
    deadline = time.monotonic() + req.timeout_s
    while time.monotonic() < deadline:
        summary = read_record(req.out / "summary.json") or {}
        request = summary.get("request", {})
        ours = (request.get("node_rank"), request.get("rdzv_endpoint"), request.get("nnodes"))
        if summary.get("status") == "running" and ours == (0, req.rdzv_endpoint, req.nnodes):
            return summary["owner"]["token"]
        time.sleep(POLL_S)
    raise ValueError(
        f"node {req.node_rank}: no running run of node 0 with --rdzv-endpoint {req.rdzv_endpoint} and "
        f"--nnodes {req.nnodes} in {str(req.out)!r} within {req.timeout_s:g} s; allowed: the --out node 0 was given"
    )


def _await_canonical(req: RunRequest) -> dict:
    """Node R > 0: node 0's canonical result (its ranks compare against it), or why there is none."""
    deadline = time.monotonic() + req.timeout_s
    while time.monotonic() < deadline:
        summary = read_record(req.out / "summary.json") or {}
        canonical = summary.get("canonical")
        if canonical is not None:
            return {"status": canonical["status"], "failure": canonical.get("failure"), "from": "node 0"}
        if summary.get("status") in FINAL_STATES:
            reason = f"node 0's run ended {summary['status']} before its canonical result: {summary.get('error')}"
            return {"status": "failed", "failure": {"rank": None, "reason": reason, "log": None}}
        time.sleep(POLL_S)
    reason = f"node 0 wrote no canonical result within {req.timeout_s:g} s (--timeout)"
    return {"status": "failed", "failure": {"rank": None, "reason": reason, "log": None}}


def _run_layout(req: RunRequest, layout: Layout, token: str, rdzv_id: str) -> dict:
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
    spec_path = d / ("spec.json" if req.leader else f"spec.node{req.node_rank}.json")  # paths are per machine
    write_json(spec_path, spec)
    per_node = req.agents == "per-node" and req.rdzv_endpoint is None
    res = launch(
        "h3lab.run.workers.rank",
        [str(spec_path.resolve())],
        nproc_per_node=layout.local if (per_node or req.nnodes > 1) else layout.world,
        log_dir=d,
        timeout_s=req.timeout_s,
        agents=layout.nodes if per_node else 1,
        nnodes=req.nnodes,
        node_rank=req.node_rank,
        rdzv_endpoint=req.rdzv_endpoint,
        token=token,
        rdzv_id=rdzv_id,
    )
    record: dict = {"world": layout.world, "launch": _launch_record(res)}
    if res.ok and req.nnodes > 1:  # other machines' ranks may still be writing their files
        res = _await_ranks(d, layout.world, res, time.monotonic() + req.timeout_s)
    if not res.ok:
        return record | {"status": "failed", "failure": diagnose(d, layout.world, res)}
    if not req.leader:
        return record | {"status": "passed", "note": "ranks of this node finished; node 0 assembles"}
    return record | _compare_layout(req, layout, d)


def _await_ranks(d: Path, world: int, res: LaunchResult, deadline: float) -> LaunchResult:
    """Wait until every rank's status is final; a rank that failed (or never finished) fails the launch."""
    while True:
        states = [(read_record(d / f"rank{r}.status.json") or {}).get("state") for r in range(world)]
        if all(s == "done" for s in states):
            return res
        if any(s in ("error", "terminated") for s in states) or time.monotonic() > deadline:
            timed_out = not any(s in ("error", "terminated") for s in states)
            return dataclasses.replace(res, returncode=1, timed_out=timed_out)
        time.sleep(POLL_S)


def _compare_layout(req: RunRequest, layout: Layout, d: Path) -> dict:
    """Node 0: the layout's shards assembled, compared with the canonical result byte for byte."""
    ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(layout.world)]
    num_rows = tasks.num_rows(req.problem)
    full, consistent = _assemble(d, layout, req.problem.config(), num_rows)
    canon = load_file(str(req.out / "canonical.safetensors"))
    write_tensors(req.out / "layouts" / f"{slug(layout)}.safetensors", full)
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
    record = {
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
    if req.problem.task == "train":
        record["steps"] = step_verdicts(tensors)
    if req.trace:
        trace, order = assemble_trace(d, layout, num_rows or 0)
        save_trace(req.out / "layouts" / f"{slug(layout)}.trace", trace, order)
        canon_trace, canon_order = load_trace(req.out / "canonical.trace")
        record["first_divergence"] = first_divergence(canon_trace, canon_order, trace)
    return record


def _assemble(d: Path, layout: Layout, config, num_rows: int | None) -> tuple[dict[str, torch.Tensor], bool]:
    """The full result from the ranks' shards (h3lab.parallel.assemble, h3lab.run.tasks naming); checks
    that replicas agree byte for byte."""
    parts = [load_file(str(d / f"rank{r}.safetensors")) for r in range(layout.world)]
    consistent = replicas_agree(parts, layout, tasks.space_of)
    full = full_tensors(parts, layout, tasks.space_of, num_rows)
    return tasks.assemble_units(full, config, units=range(NUM_UNITS)), consistent


def _launch_record(res: LaunchResult) -> dict:
    return {
        "returncode": res.returncode,
        "timed_out": res.timed_out,
        "elapsed_s": res.elapsed_s,
        "token": res.token,
        "commands": [shlex.join(c) for c in res.commands],
        "agent_logs": [str(p) for p in res.agent_logs],
        "agent_codes": res.agent_codes,
        "killed_leftovers": res.killed_leftovers,
    }
