"""A fused attention backward with dq summed in key-block order, in Triton: a measured candidate.

One program per (key block, head) computes dk, dv with attention_bwd_kv's step (_dkdv_grads: the
same bits) and, per query block, dq's partial dS @ K over its key block from the same dS. The
partials of a query block are added into an FP32 dq in ascending key-block order: a turn counter
per (head, query block) lets key block j add only after key block j - 1 has (acquire / release
atomics). So a query row's dq = ((0 + P_0) + P_1) + ... over key blocks, an order fixed by the
key-block index alone: within the h3-parallel-v1 contract (row-local, independent of the query
split and the row count), the bits of the pinned sm90 dq (its Gluon form, attention_fused_sm90:
the GPU tests compare them), other bits than the Triton dq kernel's (which chains dS @ K through
one accumulator).

It exists to measure what an ordered dq costs when the compute warps wait their turn themselves
(h3lab.bench.attention_fused_bwd); FlashAttention-3's deterministic backward hands the ordered adds
to a producer warp (asynchronous TMA reduce-add), which Triton does not let a kernel express.
Key block j spins until j - 1 has added, which needs j - 1 resident or done: CUDA dispatches a
grid's blocks in launch order in practice (it does not promise it; FA3 relies on the same), and
the interpreter runs them one at a time, grid axis 0 outermost: in either launch order below a
head's key block j - 1 runs before its key block j.

The launch order decides how long a turn waits on a GPU (ORDERS; the bits are the same under both,
each query block's adds run in key-block order either way; CUDA dispatches grid axis 0 fastest).
"keys_first" (grid axis 0 = key blocks) fills the GPU with one head's key blocks: block j reaches
query block i only after j - 1 has passed it, so the resident blocks of that head form a
wavefront, block j starting j turns late, and a head's n_kb blocks finish after about n_qb + n_kb
turns instead of n_qb. "heads_first" (axis 0 = heads) fills it with every head's first key
blocks, each waiting only for its own head's block one grid row earlier. That wavefront was
expected to be the cost; the H200 says otherwise: heads_first is the slower order, and most of the
time goes to the turns and the per-element dq atomics themselves (python -m
h3lab.bench.attention_fused_bwd times both orders and the diagnostics, reports/h200/).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.triton.attention import CONFIG_KEYS, _bwd_meta, _row_desc
from h3lab.triton.attention_args import DQ_MODES, F32, LOG2E, bwd_operands, check_modes, strides
from h3lab.triton.attention_bwd import _dkdv_grads, _key_tiles
from h3lab.triton.configs import cdiv


# One function on purpose: a jit kernel; dq's ordered adds (a turn counter, acquire/release) sit in the
# loop that accumulates dk, dv, and its signature is fixed (top-level descriptors, do_not_specialize).
@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_bwd_fused_kernel(
    q_desc,
    do_desc,
    stats,
    keys,
    grads,
    dq_ptr,
    turn_ptr,
    n_q,
    n_k,
    qk_scale,
    scale,
    key_strides,
    grad_strides,
    dq_strides,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    DQ_MODE: tl.constexpr,
):
    """grads dk, dv [n_k, H, D] FP32 of this key block; dq [n_q, H, D] FP32 (zeroed) += this key block's
    part, in key-block order; turn [H, cdiv(n_q, BLOCK_M)] int32 (zeroed) counts the key blocks added.
    stats (lse2, delta), keys (k, v); the strides are each tensor's (row, head) strides. HEADS_FIRST:
    program_id(0) is the head and program_id(1) the key block; else the reverse. DQ_MODE: the index
    of DQ_MODES (0, ordered: the kernel; 1 and 2 are diagnostics)."""
    lse_ptr, delta_ptr = stats
    dk_ptr, dv_ptr = grads
    stride_gm, stride_gh = grad_strides
    stride_dqm, stride_dqh = dq_strides
    if HEADS_FIRST:
        h = tl.program_id(0)
        j = tl.program_id(1)
    else:
        j = tl.program_id(0)
        h = tl.program_id(1)
    col = h * HEAD_DIM
    h64 = h.to(tl.int64)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # padded key rows load k = v = 0; their dS is zeroed below so they add nothing to dq
    k, v, key_ok, key_rows = _key_tiles(keys, key_strides, h64, n_k, offs_n, offs_d)
    stat = h64 * n_q
    n_qb = tl.cdiv(n_q, BLOCK_M)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for i in range(n_qb):
        rows = offs_m + i * BLOCK_M
        row_ok = rows < n_q
        q = q_desc.load([i * BLOCK_M, col])
        do = do_desc.load([i * BLOCK_M, col])
        lse = tl.load(lse_ptr + stat + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + stat + rows, mask=row_ok, other=0.0)
        dk, dv, ds_t = _dkdv_grads(dk, dv, k, v, q, do, lse, delta, row_ok, qk_scale, True, DOT_PREC)
        ds_t = tl.where(key_ok[:, None], ds_t, 0.0)  # padded keys: k = 0, but their p may overflow
        if DQ_MODE != 2:
            part = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PREC)  # [BLOCK_M, Dh] over this key block
            turn = turn_ptr + h * n_qb + i
            if DQ_MODE == 0:
                while tl.atomic_cas(turn, j, j, sem="acquire") != j:
                    pass
            ptrs = dq_ptr + h64 * stride_dqh + rows.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :]
            tl.atomic_add(ptrs, part, mask=row_ok[:, None], sem="relaxed")
            if DQ_MODE == 0:
                tl.debug_barrier()  # every thread's adds issued before the turn passes on
                tl.atomic_xchg(turn, j + 1, sem="release")
    dk = dk * scale
    out = h64 * stride_gh + key_rows * stride_gm + offs_d[None, :]
    tl.store(dk_ptr + out, dk, mask=key_ok[:, None])
    tl.store(dv_ptr + out, dv, mask=key_ok[:, None])


def attention_bwd_fused(
    q: Tensor,
    do: Tensor,
    stats: Sequence[Tensor],
    delta: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    config: Mapping[str, Any],
    order: str = "heads_first",
    dq_mode: str = "ordered",
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [Q, H, Dh], dk, dv [K, H, Dh]) FP32 under `config` (BLOCK_M, BLOCK_N, num_warps, num_stages):
    dk, dv are attention_bwd_kv's bytes with the same tile; dq is summed in key-block order. `order`,
    one of ORDERS, is the launch order (the same bytes under each); `dq_mode`, one of DQ_MODES, is
    "ordered" but for the benchmark's diagnostics."""
    check_modes("attention_bwd_fused", order, dq_mode)
    unknown = set(config) ^ (CONFIG_KEYS["attention_bwd_kv"] - {"TMA"})
    if unknown:
        allowed = sorted(CONFIG_KEYS["attention_bwd_kv"] - {"TMA"})
        raise ValueError(
            f"attention_bwd_fused config {dict(config)}: keys {sorted(unknown)} wrong; needs exactly {allowed}"
        )
    q, do, k, v, lse, delta = bwd_operands(q, do, stats, delta, k, v, scale)
    (Q, H, Dh), K = q.shape, k.shape[0]
    descs = [_row_desc(t, config["BLOCK_M"]) for t in (q, do)]
    if Q == 0 or any(d is None for d in descs):
        shapes = f"q {tuple(q.shape)} strides {q.stride()}, dO {tuple(do.shape)} strides {do.stride()}"
        raise ValueError(
            f"attention_bwd_fused loads q and dO through TMA: {shapes}; allowed: Q > 0, heads side by side "
            "(stride(1) == Dh), rows of >= H * Dh elements, 16-byte aligned"
        )
    dq = torch.zeros((Q, H, Dh), dtype=F32, device=q.device)
    dk = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    dv = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    turn = torch.zeros((H, cdiv(Q, config["BLOCK_M"])), dtype=torch.int32, device=q.device)
    n_kb = cdiv(K, config["BLOCK_N"])
    attention_bwd_fused_kernel[(H, n_kb) if order == "heads_first" else (n_kb, H)](
        *descs,
        (lse, delta),
        (k, v),
        (dk, dv),
        dq,
        turn,
        Q,
        K,
        scale * LOG2E,
        scale,
        strides(k, v),
        strides(dk),
        strides(dq),
        **_bwd_meta(config, Dh, q.dtype),
        HEADS_FIRST=order == "heads_first",
        DQ_MODE=DQ_MODES.index(dq_mode),
    )
    return dq.mul_(scale), dk, dv
