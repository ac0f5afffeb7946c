"""Every host synchronisation one canonical GPU block (or training step) makes, with the h3lab line that made it.

`python -m h3lab.bench.sync_sites [--rows 264] [--config real] [--train-blocks N] [--out F.json]`
runs the block twice (the first compiles) under torch.cuda.set_sync_debug_mode("warn") and prints,
per call site, how many times the second run synchronised there; with `--train-blocks N`, the
training step of blocks 0..N-1 with the embedders, refiner and heads (`Trainer.step`, step 3: the
optimizer's state made at step 1) instead. `--out` also writes {"total", "sites"} as JSON. A sync
mid-step drains the GPU's queue; the host must then refill it before the GPU has work again.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from h3lab.backend import get_backend
from h3lab.batch import packed_batch
from h3lab.block import canonical_block
from h3lab.config import NAMED_CONFIGS, H3Config
from h3lab.io.jsonfile import write_json
from h3lab.model.packing import min_request_rows
from h3lab.weights import synthetic_block


def sync_sites(config: str, rows: int, backend: str) -> dict[str, int]:
    dev = torch.device("cuda")
    w = synthetic_block(H3Config.named(config), 0, seed=0).to(dev)
    b = packed_batch(w.config, rows, seed=1).to(dev)
    be = get_backend(backend, dev)
    canonical_block(w, b, backend=be)
    torch.cuda.synchronize()
    return sites_of(lambda: canonical_block(w, b, backend=be), skip="sync_sites")


def train_step_sites(config: str, rows: int, blocks: int, backend: str) -> dict[str, int]:
    """The host synchronisations of `Trainer.step(3)` of blocks 0..blocks-1 (real weights' dtypes)."""
    from h3lab.model.packing import request_of_rows
    from h3lab.model.weights import SyntheticWeights
    from h3lab.train.adamw import AdamWHyper
    from h3lab.train.step import Trainer

    dev = torch.device("cuda")
    c = H3Config.named(config).replace(num_layers=blocks)
    weights = SyntheticWeights(c, seed=0, device=dev, generator=dev)
    inputs = request_of_rows(c, rows, 1).to(dev)
    hyper = AdamWHyper(lr=1e-5, max_grad_norm=1.0)
    t = Trainer(weights, inputs, blocks=range(blocks), hyper=hyper, seed=0, backend=get_backend(backend, dev))
    t.step(1)
    t.step(2)
    return sites_of(lambda: t.step(3), skip="sync_sites")


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=264)
    ap.add_argument("--config", default="real", choices=sorted(NAMED_CONFIGS))
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--train-blocks", type=int, default=None, help="the training step of blocks 0..N-1 instead")
    ap.add_argument("--out", type=Path, default=None, help="also write {total, sites} here (JSON)")
    a = ap.parse_args(argv)
    if a.rows < 1 or (a.train_blocks is not None and a.train_blocks < 1):
        ap.error(f"--rows {a.rows}, --train-blocks {a.train_blocks}; allowed: rows >= 1, train blocks >= 1")
    least = min_request_rows(H3Config.named(a.config))
    if a.train_blocks is not None and a.rows < least:
        ap.error(f"--rows {a.rows} for a training step; allowed: >= {least} (a request of every stream, {a.config})")
    if not torch.cuda.is_available():
        ap.error("no CUDA device; allowed: a GPU node (the sites are what CUDA reports)")
    if a.train_blocks is None:
        sites, what = sync_sites(a.config, a.rows, a.backend), "one block"
    else:
        sites, what = (
            train_step_sites(a.config, a.rows, a.train_blocks, a.backend),
            f"one step of {a.train_blocks} blocks",
        )
    total = sum(sites.values())
    print(f"{total} synchronisations in {what} ({a.backend}, {a.rows} rows):")
    for site, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {site}")
    if a.out is not None:
        write_json(a.out, {"total": total, "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1]))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
