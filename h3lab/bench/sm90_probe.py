"""One GPU command for what the CPU emulator of the sm90 kernels needs from an H200 (issue 31).

    python -m h3lab.bench.sm90_probe --out DIR [--parts mma,tree,sfu,sfu_model,capture,...]   (CUDA)
    python -m h3lab.bench.sm90_probe --check DIR                                              (any CPU)

Parts, in order: `mma` (h3lab.bench.mma_probe: the tensor cores' addition, ~2 x 10^6 dots through
the kernels' tl.dot tiles, compared in place with h3lab.emulate.mma), `tree` (tree_probe: tl.sum's
order in attention's layouts), `sfu` (sfu_probe: ex2.approx, MUFU.RCP under div.full, libdevice's
log2), `sfu_model` (sfu_sweeps.model_check: h3lab.emulate.sfu against the unit over every 2^32
input, mismatches counted in place), `capture` (sm90_capture: the tiny reference block with every
backend call's tensors, and spot samples of every call of the real-shape block, with their digests
against kernels/golden/sm90.json), `capture_trajectory` (sm90_capture: the golden trajectory with
every call's tensors; not in the default parts).
A part that fails is recorded with the end of its traceback; the others still run. DIR/summary.json
is rewritten after every part ("status": "running", then "passed" when every part ran, else
"failed") with the environment and each file's size against what the device returns (at most 8
files of 16 MiB, 64 MiB in all, no folder). --check recomputes what a CPU can from the files alone.
"""

from __future__ import annotations

import argparse
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3lab.io.jsonfile import write_json

PARTS = ("mma", "tree", "sfu", "sfu_model", "capture", "capture_trajectory")
LIMITS = {"files": 8, "file_bytes": 16 << 20, "total_bytes": 64 << 20}
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _runners(device: torch.device, mma_seed_base: int = 1000) -> dict[str, Callable[[Path], dict[str, Any]]]:
    from h3lab.backend import get_backend
    from h3lab.bench import mma_probe, sfu_probe, sfu_sweeps, sm90_capture, tree_probe

    return {
        "mma": lambda out: mma_probe.probe(out, device, seed_base=mma_seed_base),
        "tree": lambda out: tree_probe.probe(out, device),
        "sfu": lambda out: sfu_probe.probe(out, device),
        "sfu_model": lambda out: sfu_sweeps.model_check(sfu_probe.gpu_op, device),
        "capture": lambda out: sm90_capture.probe(out, get_backend("triton", device), device),
        "capture_trajectory": lambda out: sm90_capture.probe(
            out, get_backend("triton", device), device, captures=("trajectory",)
        ),
    }


def files_record(out_dir: Path) -> dict[str, Any]:
    """Every file under out_dir with its size, and whether the set fits LIMITS."""
    files = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file() and not p.name.startswith(".")}
    fits = len(files) <= LIMITS["files"] and sum(files.values()) <= LIMITS["total_bytes"]
    fits = fits and all(n <= LIMITS["file_bytes"] and NAME.match(k) for k, n in files.items())
    return {"files": files, "total_bytes": sum(files.values()), "fits_limits": fits, "limits": LIMITS}


def run(out_dir: Path, parts: list[str], runners: dict[str, Callable[[Path], dict[str, Any]]], env: dict) -> dict:
    """Each part in order into out_dir, summary.json rewritten after every one; the final record."""
    summary: dict[str, Any] = {"format": "h3lab-sm90-probe-v1", "status": "running", "environment": env, "parts": {}}
    path = out_dir / "summary.json"
    write_json(path, summary)
    for name in parts:
        t0 = time.perf_counter()
        try:
            record = runners[name](out_dir) | {"status": "passed"}
        except Exception as e:  # recorded, and the next part runs: one GPU session answers what it can
            record = {
                "status": "failed",
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        summary["parts"][name] = record | {"seconds": round(time.perf_counter() - t0, 1)}
        summary |= files_record(out_dir)
        write_json(path, summary)
    summary["status"] = "passed" if all(p["status"] == "passed" for p in summary["parts"].values()) else "failed"
    write_json(path, summary | files_record(out_dir))
    return summary


def check(out_dir: Path) -> dict[str, Any]:
    """Offline on a CPU: each part's saved data against the models (parts that ran)."""
    import json

    from h3lab.bench import mma_probe, sfu_probe, tree_probe

    parts = json.loads((out_dir / "summary.json").read_text())["parts"]
    checks = {"mma": mma_probe.check, "tree": tree_probe.check, "sfu": sfu_probe.check}
    return {name: fn(out_dir) for name, fn in checks.items() if parts.get(name, {}).get("status") == "passed"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="run on this machine's GPU and write everything here")
    ap.add_argument("--parts", default=",".join(PARTS[:-1]), help=f"comma-separated, of {list(PARTS)}")
    ap.add_argument("--check", type=Path, help="check a folder's files on this CPU")
    ap.add_argument("--mma-seed-base", type=int, default=1000, help="the mma cases' first seed (another: fresh draws)")
    args = ap.parse_args(argv)
    if args.check:
        import json

        print(json.dumps(check(args.check), indent=1))
        return 0
    parts = args.parts.split(",")
    if args.out is None or any(p not in PARTS for p in parts):
        ap.error(f"give --out DIR (or --check DIR); --parts of {list(PARTS)}")
    if not torch.cuda.is_available():
        ap.error("--out runs the probes on a CUDA GPU; this machine has none (use --check DIR offline)")
    from h3lab.io.env import capture

    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = run(args.out, parts, _runners(device, args.mma_seed_base), capture(device))
    print(
        f"sm90_probe: {summary['status']}; "
        + ", ".join(f"{k} {v['status']} {v['seconds']} s" for k, v in summary["parts"].items())
    )
    for name, part in summary["parts"].items():
        if isinstance(part.get("mismatches"), dict):  # an in-place model check: its counts
            print(f"{name} mismatches: {part['mismatches']} of {part['inputs']}")
    return 0 if summary["status"] == "passed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
