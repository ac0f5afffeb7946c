"""Every host synchronisation one canonical GPU block makes, with the h3lab line that made it.

`python -m h3lab.bench.sync_sites [--rows 264] [--config real]` runs the block twice (the first
compiles) under torch.cuda.set_sync_debug_mode("warn") and prints, per call site, how many times
the second run synchronised there. A sync mid-block drains the GPU's queue; the host must then
refill it before the GPU has work again.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings
from collections.abc import Callable

import torch

from h3lab.backend import get_backend
from h3lab.batch import packed_batch
from h3lab.block import canonical_block
from h3lab.config import H3Config
from h3lab.weights import synthetic_block


def sync_sites(config: str, rows: int, backend: str) -> dict[str, int]:
    dev = torch.device("cuda")
    w = synthetic_block(H3Config.named(config), 0, seed=0).to(dev)
    b = packed_batch(w.config, rows, seed=1).to(dev)
    be = get_backend(backend, dev)
    canonical_block(w, b, backend=be)
    torch.cuda.synchronize()
    return sites_of(lambda: canonical_block(w, b, backend=be), skip="sync_sites")


def sites_of(run: Callable[[], object], skip: str) -> dict[str, int]:
    """The host synchronisations of `run()` (CUDA), by the innermost three h3lab frames that are not
    in a file whose path contains `skip` (the caller's own)."""
    sites: collections.Counter[str] = collections.Counter()

    def record(message: object, *args: object, **kwargs: object) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "/h3lab/" in f.filename and skip not in f.filename]
        sites[" <- ".join(f"{f.filename.split('/h3lab/')[-1]}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    under_sync_warnings(run, record)
    return dict(sites)


def under_sync_warnings(run: Callable[[], object], seen: Callable[..., None]) -> None:
    """`run()` with torch.cuda's sync debug mode at "warn", every warning handed to `seen` (as
    `warnings.showwarning` takes it); the device drained first, the mode and the warning filters
    restored after."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = seen
            run()
    finally:
        torch.cuda.set_sync_debug_mode(before)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=264)
    ap.add_argument("--config", default="real")
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    a = ap.parse_args()
    sites = sync_sites(a.config, a.rows, a.backend)
    print(f"{sum(sites.values())} synchronisations in one block ({a.backend}, {a.rows} rows):")
    for site, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {site}")


if __name__ == "__main__":
    main()
