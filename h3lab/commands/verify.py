"""`h3lab verify`: does this machine reproduce the published bits of its node type?"""

from __future__ import annotations

import argparse

from h3lab.cli import command


@command("verify", "recompute the golden digests of the reference problem and compare with the published ones")
def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=["torch", "triton"], default="torch")
    p.add_argument("--record", action="store_true", help="write this machine's digests into kernels/golden/")

    def handle(a: argparse.Namespace) -> int:
        from h3lab import golden

        if a.record:
            print(f"recorded {golden.record(a.backend, a.device)}")
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
