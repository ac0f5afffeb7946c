"""`h3lab run`: launch layouts through torchrun and compare every rank with the canonical block."""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from h3lab.backend import CONTRACT_BACKENDS
from h3lab.parallel.layout import ALL_LAYOUTS, parse_layouts
from h3lab.run.problem import WEIGHTS_GENERATORS, Problem
from h3lab.run.runner import RunRequest, run
from h3lab.run.summary import format_summary


def add_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    _add_problem_arguments(p)
    _add_launch_arguments(p)

    def handle(a: argparse.Namespace) -> int:
        req = RunRequest(
            layouts=tuple(parse_layouts(a.layout)),
            problem=_problem(a),
            out=a.out or default_out(),
            timeout_s=a.timeout,
            algorithm=a.algorithm,
            agents=a.agents,
            nnodes=a.nnodes,
            node_rank=a.node_rank,
            rdzv_endpoint=a.rdzv_endpoint,
            trace=a.trace,
        )
        summary = run(req)
        print(format_summary(summary))
        print(f"run directory: {req.home}")
        return 0 if summary["status"] == "passed" else 1

    return handle


def _add_problem_arguments(p: argparse.ArgumentParser) -> None:
    """What a run computes and compares: the layouts, the weights, the task, the rows, the kernels."""
    p.add_argument("--layout", nargs="+", required=True, metavar="L", help=f"{', '.join(ALL_LAYOUTS)} or all")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", choices=["tiny", "real"], help="synthetic weights of a named config")
    src.add_argument("--checkpoint", type=Path, help="a diffusers checkpoint folder")
    p.add_argument("--block", type=int, default=0, help="block index (default 0)")
    p.add_argument("--blocks", default=None, metavar="A-B", help="a chain of blocks A..B (inclusive), e.g. 0-49")
    p.add_argument(
        "--trajectory",
        type=int,
        default=None,
        metavar="STEPS",
        help="a denoising trajectory of STEPS sampler steps through the whole model (blocks 0..B of --blocks)",
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=None,
        metavar="N",
        help="N training steps through blocks A..B of --blocks with the embedders and heads: the loss, every "
        "gradient and every updated weight compared after each step",
    )
    _add_train_arguments(p)
    p.add_argument("--trace", action="store_true", help="record every op and name each layout's first divergence")
    p.add_argument(
        "--digests",
        action="store_true",
        help="compare weight gradients (and a training run's weights) by digest per unit slice, keeping only rows "
        "and scalars as tensors (for runs too big to store them)",
    )
    p.add_argument("--weights-seed", type=int, default=0, help="seed of synthetic weights")
    p.add_argument(
        "--weights-generator",
        choices=WEIGHTS_GENERATORS,
        default="device",
        help="who draws the synthetic weights of a chain, trajectory or training run: the run device's generator "
        "(on a GPU another set than a CPU's, drawn in seconds) or the CPU's (the set a CPU can reproduce)",
    )
    p.add_argument("--rows", type=int, default=None, help="packed rows of a block's or a chain's batch (default 264)")
    p.add_argument("--padding", type=int, default=None, help="padding rows inside that batch (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the packed batch")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=CONTRACT_BACKENDS, default="torch")
    p.add_argument("--mode", choices=["deterministic", "baseline"], default="deterministic")
    p.add_argument("--repeats", type=int, default=1, help="block steps per rank (timing)")


def _add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """Where a run writes, how long each phase may take, and how its processes start."""
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/run-<time>-<hex>)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per phase: the canonical process, each layout")
    p.add_argument("--algorithm", choices=["auto", "gather_tree", "scatter_tree"], default="auto")
    p.add_argument(
        "--agents",
        choices=["one", "per-node"],
        default="one",
        help="per-node: one torchrun agent per layout node on 127.0.0.1",
    )
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 (several machines)")


def _problem(a: argparse.Namespace) -> Problem:
    """The flags as a Problem: their combinations are checked here, every value by `Problem.validate`
    (the one validator, which the notebooks' parameters call too)."""
    first, last = _block_range(a.blocks, a.block)
    return Problem(
        synthetic=a.synthetic,
        checkpoint=str(a.checkpoint) if a.checkpoint else None,
        block=first,
        last_block=last,
        task=_task(a),
        steps=a.trajectory or a.train_steps or 2,
        **_train_fields(a),
        digests=a.digests,
        weights_seed=a.weights_seed,
        weights_generator=a.weights_generator,
        **_batch_fields(a),
        seed=a.seed,
        device=a.device,
        backend=a.backend,
        mode=a.mode,
        repeats=a.repeats,
    )


def default_out() -> Path:
    """runs/run-<time>-<6 hex>: the random suffix keeps runs started in the same second apart."""
    return Path("runs") / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _task(a: argparse.Namespace) -> str:
    """The task the arguments ask for: a trajectory, training steps, a chain of blocks, or one block."""
    if a.trajectory is not None and a.trajectory < 1:
        raise ValueError(f"--trajectory {a.trajectory}; allowed: a number of sampler steps >= 1")
    if a.train_steps is not None and a.train_steps < 1:
        raise ValueError(f"--train-steps {a.train_steps}; allowed: a number of training steps >= 1")
    if a.trajectory is not None and a.train_steps is not None:
        raise ValueError("--trajectory and --train-steps together; allowed: one of them")
    if a.train_steps is not None:
        return "train"
    return "trajectory" if a.trajectory is not None else ("chain" if a.blocks else "block")


# flag -> Problem field of a training run's options; given without --train-steps they are refused
_TRAIN_FLAGS = {
    "--lr": "lr",
    "--betas": "betas",
    "--eps": "eps",
    "--weight-decay": "weight_decay",
    "--max-grad-norm": "max_grad_norm",
    "--row-order": "row_order",
}


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training (--train-steps)", "AdamW (h3lab.train.adamw) and the request's rows")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3)")
    g.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"), help="default 0.9 0.999")
    g.add_argument("--eps", type=float, default=None, help="default 1e-8")
    g.add_argument("--weight-decay", type=float, default=None, help="decoupled weight decay (default 1e-2)")
    g.add_argument(
        "--max-grad-norm", type=float, default=None, help="clip the global norm to this (default 1.0; inf: no clip)"
    )
    g.add_argument(
        "--row-order",
        choices=["packed", "shuffled"],
        default=None,
        help="the request's rows as the pipeline packs them (default) or out of key order",
    )
    p.add_argument(
        "--text-rows",
        type=int,
        default=None,
        help="text rows of the request of --trajectory or --train-steps (default 12: 96 packed rows)",
    )


def _train_fields(a: argparse.Namespace) -> dict:
    """The Problem fields of the training options given; a training option without --train-steps is refused."""
    given = {flag: getattr(a, field) for flag, field in _TRAIN_FLAGS.items() if getattr(a, field) is not None}
    if given and a.train_steps is None:
        raise ValueError(f"{', '.join(given)} without --train-steps; allowed: training options with --train-steps N")
    if a.text_rows is not None and a.trajectory is None and a.train_steps is None:
        raise ValueError(f"--text-rows {a.text_rows} without --trajectory or --train-steps; allowed: one of them")
    fields = {_TRAIN_FLAGS[flag]: v for flag, v in given.items()}
    return fields | ({"text_rows": a.text_rows} if a.text_rows is not None else {})


def _batch_fields(a: argparse.Namespace) -> dict:
    """--rows and --padding: a block's or a chain's batch. A trajectory or training request is packed
    from its streams (--text-rows), so there they are refused, never ignored."""
    given = {flag: v for flag, v in (("--rows", a.rows), ("--padding", a.padding)) if v is not None}
    if given and (a.trajectory is not None or a.train_steps is not None):
        raise ValueError(
            f"{', '.join(given)} with --trajectory or --train-steps; allowed: --text-rows for the request's "
            "text rows (its video and audio rows come from the packing)"
        )
    return {"rows": 264 if a.rows is None else a.rows, "padding": 0 if a.padding is None else a.padding}


def _block_range(blocks: str | None, block: int) -> tuple[int, int | None]:
    if blocks is None:
        return block, None
    first, sep, last = blocks.partition("-")
    if not (first.isdigit() and (not sep or last.isdigit())):
        raise ValueError(f"--blocks {blocks!r}; allowed: A-B with A <= B, e.g. 0-49, or a single index")
    return int(first), int(last or first)
