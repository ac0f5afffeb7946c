"""`h3lab accuracy`: synthesize a checkpoint, load one block, measure it against the FP64 oracle and diffusers.

A run folder (claimed exclusively, h3lab.io.rundir) holds `owner.json`, `checkpoint/` (unless
`--checkpoint` names one) and `summary.json`, rewritten atomically: "running" from the start, then
"passed" or "failed" with the table, or "failed" / "interrupted" with the error.
"""

from __future__ import annotations

import argparse
import math
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from h3lab.batch import check_seed, packed_batch
from h3lab.config import NAMED_CONFIGS, H3Config, model_param_shapes, param_dtype
from h3lab.contract import describe
from h3lab.io.checkpoint import load_block, synthesize_checkpoint
from h3lab.io.env import brief, capture
from h3lab.io.jsonfile import write_json
from h3lab.io.manifest import MANIFEST_NAME, find_layout
from h3lab.io.rundir import claim, describe_end, reserve_space, write_final
from h3lab.reference.accuracy import block_accuracy, format_table
from h3lab.reference.parity import diffusers_available
from h3lab.run.limits import check_request
from h3lab.run.problem import DEVICES, Problem

SUMMARY_FORMAT = "h3lab-reproduce-v1"


def add_arguments(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--out", default=None, help="run folder (default: runs/accuracy-<UTC timestamp>)")
    parser.add_argument("--config", default="tiny", choices=NAMED_CONFIGS, help="synthetic checkpoint's shape")
    parser.add_argument("--checkpoint", default=None, help="use this checkpoint folder instead of synthesizing one")
    parser.add_argument("--block", type=int, default=0, help="transformer block to run (default 0)")
    parser.add_argument("--rows", type=int, default=264, help="packed rows of the batch (default 264)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and of the batch")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")

    def run(args: argparse.Namespace) -> int:
        check_seed(args.seed, "--seed")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        out = Path(args.out or f"runs/accuracy-{stamp}-{secrets.token_hex(2)}")  # the suffix: same-second runs
        _check_request(args, out)  # before the folder: nothing is written for a request that cannot run
        owner = claim(out)
        summary = {"format": SUMMARY_FORMAT, "status": "running", "owner": owner, "started": owner["started"]}
        summary["contract"] = describe()
        path = write_json(out / "summary.json", summary)
        try:
            reserve_space(out)  # given back for the final summary on a full disk
            summary |= _measure(args, out)
        except (KeyboardInterrupt, SystemExit) as err:
            write_final(path, summary | {"status": "interrupted", "error": describe_end(err)})
            raise
        except BaseException as err:
            write_final(path, summary | {"status": "failed", "error": describe_end(err)})
            raise
        passed = summary["determinism"]["bitwise_equal"]
        write_final(path, summary | {"status": "passed" if passed else "failed"})
        print(f"summary: {path}")
        return 0 if passed else 1

    return run


def _check_request(args: argparse.Namespace, out: Path) -> None:
    """Refuse, naming the value and what is allowed: a device torch cannot use here, a block past the
    checkpoint (or past a synthetic config's 50), rows past the memory (h3lab.run.limits), a synthetic
    checkpoint larger than the free disk under `out`."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r}; allowed: cpu, cuda or cuda:<index>") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type not in DEVICES or (device.type == "cuda" and (device.index or 0) >= count):
        raise ValueError(f"--device {args.device!r}; allowed here: cpu{f', cuda:0..{count - 1}' if count else ''}")
    source = (
        {"synthetic": args.config} if args.checkpoint is None else {"synthetic": None, "checkpoint": args.checkpoint}
    )
    check_request(
        Problem(**source, block=args.block, rows=args.rows, seed=args.seed, weights_seed=args.seed, device=device.type)
    )
    if args.checkpoint is None:
        config = H3Config.named(args.config)
        shapes = model_param_shapes(config, args.block + 1)
        need = sum(math.prod(shape) * param_dtype(k).itemsize for k, shape in shapes.items())
        where = next(d for d in (out.absolute(), *out.absolute().parents) if d.exists())
        free = shutil.disk_usage(where).free
        if need > free:
            raise ValueError(
                f"--block {args.block}: the synthesized {args.config} checkpoint of {args.block + 1} blocks takes "
                f"{need / 2**30:.3g} GiB, {where} has {free / 2**30:.3g} GiB free; allowed: a smaller --block, "
                "or --checkpoint"
            )


def _measure(args: argparse.Namespace, out: Path) -> dict:
    """The block of the run's checkpoint against the FP64 oracle and diffusers: the summary's body."""
    if args.checkpoint is None:  # only the blocks needed: the real config's 50 would be 65 GB
        config = H3Config.named(args.config)
        ckpt = synthesize_checkpoint(out / "checkpoint", config, num_blocks=args.block + 1, seed=args.seed)
        print(f"synthesized {args.config} checkpoint ({args.block + 1} block(s), seed {args.seed}): {ckpt}")
    else:
        ckpt = Path(args.checkpoint)
    verified = (find_layout(ckpt).folder / MANIFEST_NAME).is_file()
    weights = load_block(ckpt, args.block).to(args.device)
    batch = packed_batch(weights.config, args.rows, seed=args.seed).to(args.device)
    print(f"block {args.block} loaded ({'sha256-verified' if verified else 'no manifest.json: unverified'})")
    if not diffusers_available():
        print("diffusers not installed: diffusers columns skipped (pip install -e '.[parity]')")
    report = block_accuracy(weights, batch)
    print(format_table(report))
    return {
        "config": weights.config.to_dict(),
        "checkpoint": {"path": str(ckpt), "block": args.block, "manifest_verified": verified},
        "batch": {"rows": args.rows, "seed": args.seed, "timesteps": batch.num_timesteps},
        "environment": brief(capture(batch.device)) | {"device": str(batch.device), "diffusers": _diffusers_version()},
        **report,
    }


def _diffusers_version() -> str | None:
    if not diffusers_available():
        return None
    import diffusers

    return diffusers.__version__
