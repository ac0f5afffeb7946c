"""Kernel time by role (attention, GEMM, other): where the canonical block's time goes against eager's.

A kernel's role is read from its name: ours (h3lab.triton) by their exact names or, for attention,
the `attention_` prefix; the libraries the eager block runs (cuBLAS, cuDNN, FlashAttention) by parts
of theirs (cuBLAS's GEMV and split-K reduction kernels count as GEMM). A name nothing matches is
"other": norms, RoPE, row chains, elementwise ops, copies, gathers. Attention is matched first
(cuDNN's attention kernels carry "cudnn").
"""

from __future__ import annotations

from collections.abc import Iterable

ROLES = ("attention", "gemm", "other")
OUR_GEMMS = {
    "mm_kernel",
    "unit_mm_kernel",
    "unit_mm_sm90_kernel",
    "_unit_partial_kernel",
    "_few_k_kernel",
    "chain_kernel",
}
LIBRARY_ATTENTION = ("sdpa", "fmha", "flash", "cudnn")
LIBRARY_GEMM = ("gemm", "gemv", "splitkreduce", "nvjet", "xmma", "cutlass")


def role(kernel_name: str) -> str:
    name = kernel_name.lower()
    if name.startswith("attention_") or any(p in name for p in LIBRARY_ATTENTION):
        return "attention"
    if name in OUR_GEMMS or any(p in name for p in LIBRARY_GEMM):
        return "gemm"
    return "other"


def by_role(kernels_ms: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Summed milliseconds per role of (kernel name, ms) pairs; every role present, zero if unused."""
    out = dict.fromkeys(ROLES, 0.0)
    for name, ms in kernels_ms:
        out[role(name)] += ms
    return out
