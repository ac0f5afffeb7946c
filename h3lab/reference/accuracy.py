"""How accurate is one block: the canonical block against the FP64 oracle and against diffusers, per tensor.

Four runs of the same block on the same batch: the canonical block in bf16 (twice, to check bytes),
the FP64 oracle, diffusers' block in bf16 (its own error against the oracle) and, in float32, the
canonical block against diffusers' (parity). The figure per tensor is the relative L2 error
||t - ref|| / ||ref||; `error_stats` adds max_abs, max_rel and ULPs, all kept in the report.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from h3lab.batch import PackedBatch
from h3lab.block import canonical_block
from h3lab.metrics import bitwise_equal, error_stats, sha256_tensor
from h3lab.reference.oracle import oracle_block
from h3lab.reference.parity import diffusers_available, diffusers_block
from h3lab.weights import BlockWeights

COLUMNS = {  # report key -> table heading
    "canonical_bf16_vs_fp64": "canonical bf16",
    "diffusers_bf16_vs_fp64": "diffusers bf16",
    "canonical_fp32_vs_diffusers_fp32": "fp32 parity",
}


def block_accuracy(weights: BlockWeights, batch: PackedBatch, *, with_diffusers: bool | None = None) -> dict[str, Any]:
    """Errors of every tensor of one block (out, dx, dtemb, each dW) and a byte-determinism check.

    Args:
        weights: the block as stored (bf16 GEMM weights).
        batch: a bf16 batch; its float32 copy (exact) drives the parity runs.
        with_diffusers: run diffusers; None: when it is installed.

    Returns:
        JSON-ready dict: `tensors` {name: {column: error_stats dict or None}}, `determinism`,
        `seconds` per run, `diffusers` (whether it ran).

    Raises:
        ValueError: a batch that is not bf16, or any error of the block functions.
        ImportError: `with_diffusers=True` without diffusers installed.
    """
    if batch.hidden_states.dtype != torch.bfloat16:
        raise ValueError(f"batch dtype {batch.hidden_states.dtype}; allowed: torch.bfloat16 (the canonical dtype)")
    if with_diffusers is None:
        with_diffusers = diffusers_available()
    seconds: dict[str, float] = {}
    # results are reduced to statistics as soon as possible: a real block's FP64 result alone is 5 GB
    ours = _timed(seconds, "canonical_bf16", canonical_block, weights, batch)
    equal = _equal_to_a_second_run(seconds, weights, batch, ours)
    tensors = _against_oracle(seconds, weights, batch, ours, with_diffusers)
    if with_diffusers:
        _fp32_parity(seconds, weights, batch, tensors)
    return {
        "tensors": tensors,
        "determinism": {
            "runs": 2,
            "bitwise_equal": all(equal.values()),
            "tensors_differing": sorted(k for k, v in equal.items() if not v),
            "sha256": {name: sha256_tensor(t) for name, t in ours.items()},
        },
        "seconds": seconds,
        "diffusers": bool(with_diffusers),
    }


def _timed(seconds: dict[str, float], name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict:
    """`fn(*args, **kwargs).tensors()`, its wall time recorded as `seconds[name]`."""
    start = time.perf_counter()
    result = fn(*args, **kwargs).tensors()
    seconds[name] = time.perf_counter() - start
    return result


def _equal_to_a_second_run(
    seconds: dict[str, float], weights: BlockWeights, batch: PackedBatch, ours: dict
) -> dict[str, bool]:
    """Tensor name -> whether a second canonical bf16 run gives the same bytes (the second run is dropped)."""
    again = _timed(seconds, "canonical_bf16_again", canonical_block, weights, batch)
    return {name: bitwise_equal(t, again[name]) for name, t in ours.items()}


def _against_oracle(
    seconds: dict[str, float], weights: BlockWeights, batch: PackedBatch, ours: dict, with_diffusers: bool
) -> dict[str, dict[str, Any]]:
    """The table with the bf16 columns against the FP64 oracle filled (diffusers' when it runs), the rest None;
    the oracle's and diffusers' tensors are dropped once reduced."""
    fp64 = _timed(seconds, "oracle_fp64", oracle_block, weights, batch)
    tensors = {name: {k: None for k in COLUMNS} for name in fp64}
    for name, ref in fp64.items():
        tensors[name]["canonical_bf16_vs_fp64"] = error_stats(ours[name], ref)
    if with_diffusers:
        theirs = _timed(seconds, "diffusers_bf16", diffusers_block, weights, batch, dtype=torch.bfloat16)
        for name, ref in fp64.items():
            tensors[name]["diffusers_bf16_vs_fp64"] = error_stats(theirs[name], ref)
        del theirs
    return tensors


def _fp32_parity(
    seconds: dict[str, float], weights: BlockWeights, batch: PackedBatch, tensors: dict[str, dict[str, Any]]
) -> None:
    """Fill the fp32 parity column: the canonical block against diffusers', both on the exact fp32 copies."""
    batch32 = dataclasses.replace(
        batch, hidden_states=batch.hidden_states.float(), grad_out=batch.grad_out.float()
    )  # bf16 -> fp32 is exact: the same inputs
    weights32 = weights.to(dtype=torch.float32)
    ours32 = _timed(seconds, "canonical_fp32", canonical_block, weights32, batch32)
    theirs32 = _timed(seconds, "diffusers_fp32", diffusers_block, weights32, batch32, dtype=torch.float32)
    for name, t in ours32.items():
        tensors[name]["canonical_fp32_vs_diffusers_fp32"] = error_stats(t, theirs32[name].double())


def format_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width text table of relative L2 errors, plus the determinism line."""
    width = max(len(k) for k in report["tensors"])
    head = f"{'tensor':<{width}}  {COLUMNS['canonical_bf16_vs_fp64']:>14}  {COLUMNS['diffusers_bf16_vs_fp64']:>14}"
    head += f"  {'ratio':>5}  {COLUMNS['canonical_fp32_vs_diffusers_fp32']:>11}"
    lines = [
        "relative L2 error per tensor. bf16 columns: against the FP64 oracle, ratio = canonical / diffusers;",
        "fp32 parity: canonical against diffusers, both in float32.",
        head,
        "-" * len(head),
    ]
    fmt = lambda cell: "-" if cell is None else f"{cell['rel_l2']:.2e}"  # noqa: E731
    for name, cols in report["tensors"].items():
        ours, theirs = cols["canonical_bf16_vs_fp64"], cols["diffusers_bf16_vs_fp64"]
        ratio = "-" if theirs is None or not theirs["rel_l2"] else f"{ours['rel_l2'] / theirs['rel_l2']:.2f}"
        parity = cols["canonical_fp32_vs_diffusers_fp32"]
        lines.append(f"{name:<{width}}  {fmt(ours):>14}  {fmt(theirs):>14}  {ratio:>5}  {fmt(parity):>11}")
    det = report["determinism"]
    verdict = "bitwise equal" if det["bitwise_equal"] else f"DIFFER in {det['tensors_differing']}"
    lines.append(f"determinism: {det['runs']} canonical bf16 runs {verdict}; sha256(out) {det['sha256']['out']}")
    return "\n".join(lines)
