"""The sm90 kernel configurations the emulator was derived for, read from kernels/sm90.json.

The emulated arithmetic follows from a kernel's tile: a GEMM's K chunk (where the K tail's zero
products sit), attention's key block (where the online softmax rescales) and the register layouts
its row sums run in (h3lab.emulate.lanes, from the PTX and the tree probe). Those were derived for
the pinned tiles below; the emulator reads the pinned file and refuses a configuration whose
bit-fixing values differ from what it models (ValueError naming both), so a re-pinned kernel
cannot silently be emulated with its old arithmetic. Where the pinned file and this table agree,
the values come from the pinned file.
"""

from __future__ import annotations

from typing import Any

from h3lab.triton import configs

NODE = "sm90"
# per kernel (and head_dim): the values that fix the bits, as the emulator models them
MODELED_GEMM = {"gemm": {"BLOCK_K": 64, "fp32.BLOCK_K": 32}, "unit_gemm": {"BLOCK_K": 64, "fp32.BLOCK_K": 32}}
MODELED_FEW_ROWS = {"max_rows": 16, "BLOCK_K": 32, "max_k": 16}
# attention: BLOCK_M = 16 x num_warps keeps a wgmma row inside one warp (its sums within a quad);
# delta's rows stay inside a warp at 8 bf16 per lane
MODELED_ATTENTION = {
    "attention_fwd": {32: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}, 128: {"BLOCK_M": 128, "BLOCK_N": 128}},
    "attention_delta": {32: {"BLOCK_R": 32, "num_warps": 4}, 128: {"BLOCK_R": 64, "num_warps": 4}},
    "attention_bwd_q": {
        32: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4},
        128: {"IMPL": "gluon", "BLOCK_M": 64, "BLOCK_N": 128},  # dq per key block, then added in order
    },
    "attention_bwd_kv": {32: {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4}, 128: {"BLOCK_M": 64, "BLOCK_N": 128}},
}


def _check(what: str, pinned: dict[str, Any], modeled: dict[str, Any]) -> dict[str, Any]:
    differ = {k: (pinned.get(k), v) for k, v in modeled.items() if pinned.get(k) != v}
    if differ:
        got = ", ".join(f"{k}={p}" for k, (p, _) in differ.items())
        want = ", ".join(f"{k}={v}" for k, (_, v) in differ.items())
        raise ValueError(
            f"kernels/{NODE}.json {what}: {got}; allowed (what the emulator models): {want} "
            "(a re-pinned tile needs its arithmetic derived again: h3lab.bench.ptx_audit, tree_probe)"
        )
    return pinned


def gemm_block_k(kernel: str, ieee: bool) -> int:
    """BLOCK_K of `kernel` ("gemm" or "unit_gemm"): its bf16 entry, or its "fp32" one for IEEE dots."""
    cfg = configs.pinned(kernel, NODE)
    flat = {"BLOCK_K": cfg["BLOCK_K"], "fp32.BLOCK_K": cfg.get("fp32", {}).get("BLOCK_K", cfg["BLOCK_K"])}
    _check(kernel, flat, MODELED_GEMM[kernel])
    return flat["fp32.BLOCK_K" if ieee else "BLOCK_K"]


def few_rows() -> dict[str, Any]:
    """The few-row AdaLN kernels' limits and K chunk (max_rows, BLOCK_K, max_k)."""
    return _check("few_rows", configs.pinned("few_rows", NODE), MODELED_FEW_ROWS)


def attention(kernel: str, head_dim: int) -> dict[str, Any]:
    """The pinned configuration of an attention kernel at `head_dim`, checked against MODELED_ATTENTION."""
    modeled = MODELED_ATTENTION[kernel]
    if head_dim not in modeled:
        raise ValueError(f"{kernel} at head_dim {head_dim}; allowed (emulated): {sorted(modeled)}")
    cfg = configs.pinned(kernel, NODE)["by_head_dim"].get(str(head_dim), {})
    return _check(f"{kernel} head_dim {head_dim}", cfg, modeled[head_dim])
