"""`h3lab verify`: does this machine reproduce the published bits of its node type?"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from h3lab.backend import CONTRACT_BACKENDS


def add_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=CONTRACT_BACKENDS, default="torch")
    p.add_argument("--record", action="store_true", help="write this machine's digests into kernels/golden/")
    p.add_argument(
        "--real",
        action="store_true",
        help="with --record: also record the real-shape problem (GPU backends; verify checks it where published)",
    )

    def handle(a: argparse.Namespace) -> int:
        from h3lab.run import golden

        if a.record:
            print(f"recorded {golden.record(a.backend, a.device, real=a.real)}")
            return 0
        res = golden.verify(a.backend, a.device)
        for name, t in res["tensors"].items():
            print(f"{'ok  ' if t['expected'] == t['got'] else 'DIFF'} {name:32s} {t['got'][:16]}")
        if res["match"]:
            print(f"{res['node_type']} / {res['backend']}: reproduces the published bits")
            return 0
        where = f"{res['node_type']} / {res['backend']}"
        print(f"{where}: DOES NOT reproduce; first differing tensor: {res['first_mismatch']}")
        return 1

    return handle
