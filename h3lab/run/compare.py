"""`h3lab compare`: the user's own script once per layout, its records compared byte for byte.

    h3lab compare --layout tp2 tp4xcp2+sp tp8:2x4 -- python my_train.py ARGS

The script (h3lab.nn: `parallelize(model, current_layout())`, `record(name, tensor)`) runs under
torchrun through the project's one launch path (h3lab.launch.launcher: every process tagged and swept,
none outliving the run) once in one process as tp1, the reference, then once per layout; each rank
in h3lab.run.workers.script. The run folder follows `h3lab run`'s rules (h3lab.io.rundir: claimed,
never overwritten, `summary.json` ending `passed`, `failed` or `interrupted` whatever stops it, the
failing rank named by h3lab.run.diagnose):
  owner.json, request.json, env.json   the claim, what was asked (the command), the environment
  canonical/                           the reference run's spec, agent and rank logs, status, records
  canonical.safetensors                its records, by name
  layouts/<slug>/, <slug>.safetensors  each layout's ranks' files, and its records put back whole
  summary.json                         per layout and record: bit equality, ULPs, sha256; the first
                                       record (in the reference's call order) whose bits differ;
                                       per step and kind for names `step{k}.` (h3lab.run.steps)
A record every rank holds whole must have the same bytes on every rank; a parameter's shard
(h3lab.nn.recording) is put back whole from each CP group's TP ranks (h3lab.units.join_shards). The
layout's copy compared is the first copy (a rank's, or a CP group's) whose bits differ from the
reference, so a difference on any rank shows. Refused: a command that is not `python SCRIPT` or
`python -m MODULE`; a script that records nothing (after the reference run); a layout whose names
differ from the reference's, or whose ranks record different names (that layout fails).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import Tensor
from tqdm import tqdm

from h3lab.contract import describe
from h3lab.io.env import brief, capture
from h3lab.io.jsonfile import write_json
from h3lab.io.rundir import FINAL_STATES, claim, describe_end, reserve_space, write_final
from h3lab.io.tensorfile import write_tensors
from h3lab.launch.launcher import check_local_processes, launch, new_token
from h3lab.metrics import bitwise_equal, compare, sha256_tensor
from h3lab.nn.recording import LAYOUT_VAR
from h3lab.nn.state import split_name
from h3lab.parallel.layout import Layout
from h3lab.run.diagnose import diagnose
from h3lab.run.runner import _launch_record, slug
from h3lab.run.steps import step_kind, step_verdicts
from h3lab.run.summary import failure_line
from h3lab.run.trace import timeline
from h3lab.units import join_shards

WORKER = "h3lab.run.workers.script"
REFERENCE = Layout.parse("tp1")
COMMAND_FORMS = "python SCRIPT [ARGS], or python -m MODULE [ARGS]"


@dataclass(frozen=True, kw_only=True)
class CompareRequest:
    layouts: tuple[Layout, ...]
    command: tuple[str, ...]  # as typed after `--`: python SCRIPT ARGS, or python -m MODULE ARGS
    out: Path
    timeout_s: float = 600.0  # each launch: the reference and each layout
    argv: list[str] = field(default_factory=lambda: list(sys.argv))  # the h3lab command, for request.json

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError("no layouts to compare; allowed: one or more layout names")
        if not isinstance(self.timeout_s, int | float) or not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout {self.timeout_s!r} s; allowed: a finite number of seconds > 0")
        for layout in self.layouts:
            try:
                check_local_processes(layout.world)
            except ValueError as err:
                raise ValueError(f"layout {layout.name}: {err}") from None
        resolved_command(self.command)

    def worker_command(self) -> list[str]:
        return resolved_command(self.command)


def resolved_command(command: tuple[str, ...] | list[str]) -> list[str]:
    """`command` with the script's path made absolute (the ranks run it as this interpreter's `__main__`).

    Raises:
        ValueError: not one of COMMAND_FORMS, or a script that is not a file.
    """
    c = list(command)
    if not c or not Path(c[0]).name.startswith("python"):
        raise ValueError(f"command {shlex.join(c) or '(none)'!r}; allowed: {COMMAND_FORMS} after --")
    if len(c) >= 3 and c[1] == "-m":
        return c
    if len(c) < 2 or c[1].startswith("-"):
        raise ValueError(f"command {shlex.join(c)!r}; allowed: {COMMAND_FORMS} after --")
    script = Path(c[1])
    if not script.is_file():
        raise ValueError(f"script {c[1]!r} is not a file; allowed: {COMMAND_FORMS} after --")
    return [c[0], str(script.resolve()), *c[2:]]


def compare_run(req: CompareRequest) -> dict[str, Any]:
    """Run the reference and every layout of `req`; returns the summary (also `req.out/summary.json`).

    Raises:
        ValueError: the run folder cannot be claimed (nothing is written then).
        Whatever interrupted or broke the run, after summary.json says "interrupted" or "failed".
    """
    token = new_token()
    owner = claim(req.out, token=token)
    summary: dict[str, Any] = {
        "status": "running",
        "started": owner["started"],
        "owner": owner,
        "request": _request(req),
        "layouts": {},
    }
    write_json(req.out / "summary.json", summary)
    try:
        write_json(req.out / "request.json", summary["request"])
        env = capture("cpu")
        write_json(req.out / "env.json", env)
        summary |= {"contract": describe(), "environment": brief(env)}
        reserve_space(req.out)
        canonical = _reference(req, token)
        summary["canonical"] = canonical
        if canonical["status"] != "done":
            return _finish(req, summary, "failed", canonical["failure"]["reason"])
        write_json(req.out / "summary.json", summary)
        bar = tqdm(req.layouts, desc="layouts", unit="layout", disable=None, file=sys.stderr)
        for layout in bar:
            bar.set_postfix_str(layout.name)
            record = _layout(req, layout, token, canonical)
            summary["layouts"][layout.name] = record
            write_json(req.out / "summary.json", summary)
            if record["status"] != "passed":
                tqdm.write(f"{layout.name}: {verdict_line(record)}", file=sys.stderr)
    except (KeyboardInterrupt, SystemExit) as err:
        _finish(req, summary, "interrupted", describe_end(err))
        raise
    except BaseException as err:
        _finish(req, summary, "failed", describe_end(err))
        raise
    passed = all(r["status"] == "passed" for r in summary["layouts"].values())
    return _finish(req, summary, "passed" if passed else "failed", None)


def _request(req: CompareRequest) -> dict[str, Any]:
    return {
        "task": "compare",
        "layouts": [lay.name for lay in req.layouts],
        "script": shlex.join(req.command),
        "worker_command": req.worker_command(),
        "timeout_s": req.timeout_s,
        "command": shlex.join(req.argv),
        "cwd": os.getcwd(),
    }


def _finish(req: CompareRequest, summary: dict, status: str, error: str | None) -> dict:
    assert status in FINAL_STATES, status
    summary |= {"status": status, "finished": time.time()}
    summary["elapsed_s"] = summary["finished"] - summary["started"]
    if error is not None:
        summary["error"] = error
    write_final(req.out / "summary.json", summary)
    return summary


def _launch(req: CompareRequest, layout: Layout, d: Path, token: str) -> tuple[dict, Any]:
    """The script on `layout`'s ranks, its files under `d`: (the launch's record, its result)."""
    d.mkdir(parents=True, exist_ok=True)
    spec = {"layout": layout.name, "command": req.worker_command(), "dir": str(d.resolve())}
    write_json(d / "spec.json", spec)
    res = launch(
        WORKER,
        [str((d / "spec.json").resolve())],
        nproc_per_node=layout.world,
        log_dir=d,
        timeout_s=req.timeout_s,
        token=token,
        rdzv_id=f"{token}.{slug(layout)}.{d.name}",
        env={LAYOUT_VAR: layout.name},
    )
    record: dict[str, Any] = {"world": layout.world, "launch": _launch_record(res)}
    if not res.ok:
        record |= {"status": "failed", "failure": diagnose(d, layout.world, res)}
    return record, res


def _reference(req: CompareRequest, token: str) -> dict[str, Any]:
    """The script on one process (tp1): its records are what every layout must give."""
    d = req.out / "canonical"
    record, res = _launch(req, REFERENCE, d, token)
    if not res.ok:
        return record
    copies, order = _read_ranks(d, 1)
    if not order:
        reason = "the script recorded nothing; allowed: a script that calls h3lab.record(name, tensor)"
        return record | {"status": "failed", "failure": {"rank": None, "reason": reason, "log": str(d / "rank0.log")}}
    tensors = {name: copies[0][name] for name, _ in order}
    write_tensors(req.out / "canonical.safetensors", tensors)
    return record | {
        "status": "done",
        "order": [list(x) for x in order],
        "sha256": {k: sha256_tensor(v) for k, v in tensors.items()},
    }


def _layout(req: CompareRequest, layout: Layout, token: str, canonical: dict) -> dict[str, Any]:
    d = req.out / "layouts" / slug(layout)
    record, res = _launch(req, layout, d, token)
    if not res.ok:
        return record
    try:
        copies, order = _read_ranks(d, layout.world)
    except ValueError as err:
        return record | {"status": "failed", "failure": {"rank": None, "reason": str(err), "log": str(d)}}
    want = [name for name, _ in canonical["order"]]
    got = [name for name, _ in order]
    if set(got) != set(want):
        only = {layout.name: sorted(set(got) - set(want)), "tp1": sorted(set(want) - set(got))}
        which = " and ".join(f"{names[:4]} under {where} only" for where, names in only.items() if names)
        reason = f"records {which}; allowed: the same names under every layout"
        return record | {"status": "failed", "failure": {"rank": None, "reason": reason, "log": str(d)}}
    canon = load_file(str(req.out / "canonical.safetensors"))
    spaces = dict(order)
    full, consistent = {}, True
    for name in want:
        options = _copies(name, spaces[name], copies, layout)
        consistent &= all(bitwise_equal(c, options[0]) for c in options)
        full[name] = next((c for c in options if not bitwise_equal(c, canon[name])), options[0])
    write_tensors(req.out / "layouts" / f"{slug(layout)}.safetensors", full)
    tensors = {name: _verdict(full[name], canon[name], name) for name in want}
    ok = consistent and all(t["bitwise_equal"] for t in tensors.values())
    out = record | {"status": "passed" if ok else "mismatch", "replicas_consistent": consistent, "tensors": tensors}
    if any(step_kind(n) for n in want):
        out["steps"] = step_verdicts(tensors)
    out["first_divergence"] = _first_divergence(canonical["order"], tensors, canon, full)
    return out


def _read_ranks(d: Path, world: int) -> tuple[list[dict[str, Tensor]], list[tuple[str, str]]]:
    """Every rank's records and the names in call order with their spaces ("replicated", or
    "shard:<parameter>"), which every rank must share.

    Raises:
        ValueError: a rank recorded other names, in another order or in other spaces than rank 0.
    """
    copies, orders = [], []
    for r in range(world):
        entries = json.loads((d / f"rank{r}.records.json").read_text())
        orders.append([(e["name"], e["space"] if e["param"] is None else f"shard:{e['param']}") for e in entries])
        copies.append(load_file(str(d / f"rank{r}.records.safetensors")) if entries else {})
    for r, order in enumerate(orders):
        if order != orders[0]:
            diff = next((a, b) for a, b in zip([*order, None], [*orders[0], None], strict=False) if a != b)
            raise ValueError(
                f"rank {r} records {diff[0]} where rank 0 records {diff[1]}; allowed: the same names, in the same "
                "order and spaces, on every rank"
            )
    return copies, orders[0]


def _copies(name: str, space: str, copies: list[dict[str, Tensor]], layout: Layout) -> list[Tensor]:
    """The layout's copies of record `name`: every rank's (a whole tensor), or each CP group's shards
    of a parameter joined in unit order."""
    if not space.startswith("shard:"):
        return [c[name] for c in copies]
    param = split_name(space.removeprefix("shard:"))[1]
    return [join_shards(param, [copies[r][name] for r in tp]) for tp in layout.groups().tp]


def _verdict(got: Tensor, ref: Tensor, name: str) -> dict[str, Any]:
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return {
            "bitwise_equal": False,
            "error": f"{got.dtype} {list(got.shape)} against tp1's {ref.dtype} {list(ref.shape)}",
        }
    return compare(got, ref, name=name).to_dict()


def _first_divergence(order: list, tensors: dict, canon: dict[str, Tensor], full: dict[str, Tensor]) -> dict | None:
    """The first record, in the reference's call order, whose bits differ (h3lab.run.trace's row), or None."""
    for i, (name, space) in enumerate(order):
        if tensors[name]["bitwise_equal"]:
            continue
        if "error" in tensors[name]:
            return {"index": i, "name": name, "space": space, "bitwise_equal": False, "error": tensors[name]["error"]}
        return timeline(canon, [(name, space)], full)[0] | {"index": i}
    return None


def verdict_line(record: dict[str, Any]) -> str:
    """A layout's outcome in words: passed, the mismatch and its first differing record, or the failure
    (the failing rank and its log, as h3lab.run.summary.failure_line names it)."""
    if record["status"] == "failed":
        f = record["failure"]
        if f.get("rank") is None and "agent" not in f:  # a refusal of what the ranks recorded
            return f"FAILED: {f['reason']}"
        return (failure_line("", record) or "").removeprefix(": ")
    tensors = record.get("tensors", {})
    differ = sum(not t["bitwise_equal"] for t in tensors.values())
    if record["status"] == "passed":
        return f"passed: {len(tensors)} records bit-identical"
    first = (record.get("first_divergence") or {}).get("name", "none of the records (only their replicas)")
    return f"MISMATCH in {differ} of {len(tensors)} records; the first: {first}"


def format_compare(summary: dict[str, Any]) -> str:
    """One line per layout (h3lab.run.compare.verdict_line), then the reference's failure, if any, and
    the overall status."""
    lines = [f"{name}: {verdict_line(rec)}" for name, rec in summary["layouts"].items()]
    canonical = summary.get("canonical") or {}
    if canonical.get("status") == "failed":
        f = canonical["failure"]
        who = f" on rank {f['rank']}" if f.get("rank") is not None else ""
        lines.append(
            f"tp1 (the reference): FAILED{who}: {f['reason']}" + (f" (log: {f['log']})" if f.get("log") else "")
        )
    lines.append(f"overall: {summary['status']}" + (f" ({summary['error']})" if summary.get("error") else ""))
    return "\n".join(lines)
