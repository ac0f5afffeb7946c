"""`h3lab verify`: does this machine reproduce the published bits of its backend and architecture?

The torch backend is checked against the device-independent set (`kernels/golden/torch.json`), the
triton backend against its GPU architecture's (`kernels/golden/sm90.json` on an H100 or H200), and
the `emulate-sm90` backend on a CPU against the sm90 set's block, trajectory and training gate;
with `--capture` it also recomputes the spot samples of an sm90 probe's real-shape capture
(h3lab.bench.spot_check).
`--record` with it writes only which parts it reproduced (the set's `emulated` field), never digests.
Each check says which node type recorded the set and, where this node type has not reproduced a
part before, that its match is expected, not yet observed here.

Exit status: 0 reproduces the published bits; 1 differs (the first differing tensor is named);
2 a request that cannot run (one line: a backend the device cannot run, a GPU without pinned
kernels); 3 nothing is published for this backend and architecture: this machine's digests are
printed with the command that publishes them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3lab.backend import CONTRACT_BACKENDS, EMULATED

UNPUBLISHED = 3  # exit status: nothing published for this backend and architecture


def add_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.epilog = (
        "exit status: 0 reproduces the published bits, 1 differs, 2 cannot run here, "
        f"{UNPUBLISHED} nothing published for this backend and architecture (this machine's digests printed)"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=CONTRACT_BACKENDS, default="torch")
    p.add_argument(
        "--record",
        action="store_true",
        help="write this machine's digests into its set in kernels/golden/ (a published set: adds this node type "
        "as observed where the digests are equal, refuses where they differ)",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="with --record: rewrite the set with this machine's digests (only when the arithmetic is meant to change)",
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="with --record: also record the real-shape problem (GPU backends; verify checks it where published)",
    )
    p.add_argument(
        "--capture",
        type=Path,
        help=f"with --backend {'/'.join(EMULATED)}: also spot-check the real-shape problem from this sm90 probe "
        "folder's capture_real (python -m h3lab.bench.sm90_probe --out DIR on a GPU)",
    )

    def handle(a: argparse.Namespace) -> int:
        from h3lab.run import golden

        if a.replace and not a.record:
            raise ValueError("--replace without --record; allowed: --record --replace")
        if a.backend in EMULATED:
            return _emulated(a)
        if a.capture is not None:
            raise ValueError(f"--capture with --backend {a.backend}; allowed: --backend {'/'.join(EMULATED)}")
        if a.record:
            print(f"recorded {golden.record(a.backend, a.device, real=a.real, replace_set=a.replace)}")
            return 0
        res = golden.verify(a.backend, a.device)
        if res["status"] == "unpublished":
            return _print_unpublished(res)
        return _report(res, f"to add {res['node_type']} to the set's observations")

    return handle


def _report(res: dict[str, Any], record_hint: str) -> int:
    """Print a verify result (provenance, one line per tensor, the verdict); its exit status."""
    print(_provenance(res))
    for name, t in res["tensors"].items():
        print(f"{'ok  ' if t['expected'] == t['got'] else 'DIFF'} {name:32s} {(t['got'] or '-')[:16]}")
    where = f"{res['node_type']} / {res['backend']}"
    if not res["match"]:
        print(f"{where}: DOES NOT reproduce set {res['set']}; first differing tensor: {res['first_mismatch']}")
        return 1
    print(f"{where}: reproduces the published bits of set {res['set']}")
    if res["not_observed"]:
        print(f"{record_hint}: {res['record_command']}")
    return 0


def _emulated(a: argparse.Namespace) -> int:
    """verify (or --record) for an emulated backend: the digests of what a CPU computes (golden.
    EMULATED_PARTS), and the capture's spot samples when --capture names a probe folder."""
    from h3lab.run import golden

    if a.real or a.replace:
        raise ValueError(f"--real/--replace with --backend {a.backend}; allowed: --capture DIR (spot checks)")
    if a.device != "cpu":
        raise ValueError(f"backend {a.backend!r} runs on a CPU, got --device {a.device}; allowed: --device cpu")
    spot = _spot_check(a.capture, a.backend) if a.capture is not None else None
    if a.record:
        print(f"recorded {golden.record_emulated(a.backend, spot)}")
        return 0
    status = _report(golden.verify(a.backend, a.device), "to record it in the set's emulated field")
    return 1 if status or (spot is not None and (spot["mismatching"] or not spot["elements"])) else 0


def _spot_check(probe: Path, backend: str) -> dict[str, Any]:
    from h3lab.backend import get_backend
    from h3lab.bench import spot_check

    spot = spot_check.check(probe, get_backend(backend, "cpu"))
    missing = f"; not checked (missing models): {spot['missing_models']}" if spot["missing_models"] else ""
    print(f"real-shape spot check ({probe}): {spot['elements']} elements, {spot['mismatching']} mismatching{missing}")
    for method, e in spot["by_method"].items():
        if e["mismatching"]:
            print(f"DIFF {method}: {e['mismatching']} of {e['elements']} elements")
    return spot


def _provenance(res: dict[str, Any]) -> str:
    """Which set is checked, who recorded it, who reproduced what, and what this node type has not yet."""
    observed = ", ".join(f"{n} ({', '.join(parts)})" for n, parts in res["observations"].items())
    lines = [
        f"set {res['set']} ({res['path']}): backend {res['backend']} on {res['scope']}",
        f"  recorded on {res['recorded_on']}; observed on {observed}",
    ]
    if res["expected_not_observed"]:
        lines.append(f"  expected, not yet observed on: {', '.join(res['expected_not_observed'])}")
    if "emulated" in res:
        lines.append(f"  reproduced by {res['backend']} before: {', '.join(res['emulated']) or 'nothing recorded'}")
    if res["not_observed"]:
        parts = ", ".join(res["not_observed"])
        where = f"reproduced by {res['backend']}" if "emulated" in res else f"observed on {res['node_type']}"
        lines.append(f"  {parts}: expected, not yet {where} (this machine checks it now)")
    return "\n".join(lines)


def _print_unpublished(res: dict[str, Any]) -> int:
    print(
        f"no golden digests published for backend {res['backend']} on {res['set']} ({res['path']} does not exist); "
        f"this machine's digests ({res['node_type']}):"
    )
    for name, t in res["tensors"].items():
        print(f"     {name:32s} {t['got']}")
    real = " (add --real for the real-shape problem)" if res["backend"] != "torch" else ""
    print(f"to publish them: {res['record_command']}{real}; it writes {res['path']}, then commit that file")
    return UNPUBLISHED
