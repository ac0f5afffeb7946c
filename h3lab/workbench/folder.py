"""A published folder, reports/<node type>[x<GPUs>]/, as a product: built beside the old one, then swapped in.

The folder holds report.html (+ screenshot.png), report.json, env.json, data/*.parquet, one current
JSON per benchmark and a README of about one screen: what holds there, the figures with the machine
and commit each was measured on, and the one command that regenerates the folder. Nothing else:
no scripts, no logs, no superseded records (the work folder of `h3lab publish` keeps those).

A new folder is built as reports/.<name>.staging-<hex>/ and renamed into place only when complete,
so a publish that fails leaves the published folder as it was. The previous folder is deleted after
the swap only when git tracks every file in it unmodified (git history keeps it); otherwise it stays
beside as reports/.<name>.previous-<time>/ and the caller says so: nothing a user wrote is lost.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from h3lab.workbench import benchmarks as bench_tables

DIRTY_NOTE = (
    "A commit marked `, tree T` ran on a checkout with changes or new files on top of it (a device's copy "
    "of a working tree has the last landed commit as HEAD); T is the git tree of the files it ran: "
    "`git log --all --format='%h %T' | grep T` names the commit with those files."
)


def staging(reports: Path, name: str) -> Path:
    """A new, empty folder beside reports/<name>/ to build the next version in."""
    reports.mkdir(parents=True, exist_ok=True)
    path = reports / f".{name}.staging-{secrets.token_hex(3)}"
    path.mkdir()
    return path


def swap_in(built: Path, target: Path) -> Path | None:
    """Put `built` at `target`; returns where the previous folder was kept, or None (none, or deleted).

    The previous folder is renamed aside first and renamed back if the swap fails.
    """
    previous = None
    if target.exists():
        previous = target.with_name(f".{target.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
        target.rename(previous)
    try:
        built.rename(target)
    except OSError:
        if previous is not None:
            previous.rename(target)
        raise
    if previous is None:
        return None
    if _clean_in_git(previous, target):
        shutil.rmtree(previous)
        return None
    return previous


def _clean_in_git(previous: Path, target: Path) -> bool:
    """Whether git tracks every file of `previous` (the old `target`) with the content it has now."""
    repo = subprocess.run(
        ["git", "-C", str(target.parent), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if repo.returncode != 0:
        return False
    rel = target.resolve().relative_to(Path(repo.stdout.strip()).resolve())
    tracked = subprocess.run(
        ["git", "-C", repo.stdout.strip(), "ls-files", "-s", "--", str(rel)], capture_output=True, text=True
    )
    blobs = {}
    for line in tracked.stdout.splitlines():  # "<mode> <blob> <stage>\t<path>"
        meta, path = line.split("\t", 1)
        blobs[Path(path).relative_to(rel)] = meta.split()[1]
    files = [p for p in previous.rglob("*") if p.is_file()]
    if {p.relative_to(previous) for p in files} != set(blobs):
        return False
    hashed = subprocess.run(
        ["git", "hash-object", "--", *map(str, files)], capture_output=True, text=True, check=True
    ).stdout.split()
    return all(blobs[p.relative_to(previous)] == h for p, h in zip(files, hashed, strict=True))


def copy_records(folder: Path, env_json: Path, benchmarks: dict[str, dict[str, str]]) -> None:
    """env.json and each benchmark's record under its published name (benchmarks[name]["output"])."""
    shutil.copyfile(env_json, folder / "env.json")
    for entry in benchmarks.values():
        if entry.get("path"):
            shutil.copyfile(entry["path"], folder / entry["output"])


def readme(
    folder: Path, name: str, *, command: str, node: str, benchmarks: dict[str, dict[str, str]], took: str = ""
) -> Path:
    """README.md of published folder `name` (built in `folder`), from its report.json and benchmark records;
    `took` says how long the stages took, where they ran."""
    rec = json.loads((folder / "report.json").read_text())
    lines = [f"# `reports/{name}/`: {rec['title']}", ""]
    lines += [f"Regenerate this folder (on a {node.upper()} node, from the repository root){took}:", ""]
    commits = ", ".join(sorted({f"`{r['commit'] or 'not recorded'}`" for r in rec["runs"]}))
    lines += ["```", command, "```", "", f"## What holds here (commit {commits}, {rec['generated']})", ""]
    for problem, modes in rec.get("verdicts", {}).items():
        lines.append(f"- **{problem}**: " + "; ".join(_verdict(mode, v) for mode, v in modes.items()))
    lines.append("")
    lines += ["## Figures", "", "| file | what | measured on | commit |", "| --- | --- | --- | --- |"]
    lines.append(
        "| `report.html` (`screenshot.png`) | the verdicts, drift heatmaps, speed tables, accuracy | "
        f"this folder's runs | {', '.join(sorted({r['commit'] or '-' for r in rec['runs']}))} |"
    )
    for entry in benchmarks.values():
        if entry.get("path"):
            where = bench_tables.provenance(bench_tables.load(entry["path"]), entry.get("commit"))
            lines.append(f"| `{entry['output']}` | {entry['what']} | {where['machine']} | {where['commit']} |")
    lines.append("| `data/*.parquet`, `env.json` | the report's tables; the sweep's environment | | |")
    skipped = [f"`{n}` ({e['skipped']})" for n, e in benchmarks.items() if not e.get("path")]
    if skipped:
        lines += ["", "Not run here: " + "; ".join(skipped) + "."]
    if ", tree " in "\n".join(lines):
        lines += ["", DIRTY_NOTE]
    path = folder / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _verdict(mode: str, v: dict[str, Any]) -> str:
    """'deterministic: 7 of 7 layouts byte-identical to the single-process block (tp1, ...)'."""
    failed = f", {v['failed']} failed to run" if v["failed"] else ""
    if mode == "baseline":
        return f"baseline (library kernels): {v['runs'] - v['equal'] - v['failed']} of {v['runs']} differ{failed}"
    return f"{mode}: {v['equal']} of {v['runs']} byte-identical ({', '.join(v['layouts'])}){failed}"
