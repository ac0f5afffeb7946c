"""Ordering primitives for Gluon kernels on sm90: bulk-group waits, acquire loads, release stores.

What a turn counter between programs needs (h3lab.triton.attention_fused_sm90): a reader acquires
the counter, a writer releases it only after its bulk (TMA) adds' global writes are done. The waits,
loads and stores are inline PTX, the same on every lane of a warp; `tma_reduce_add` names the TMA
reduce-add under Triton 3.6 too, whose Gluon has the builder call but no Python name for it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma


@builtin
def _tma_reduce_add_36(desc, coord, src, _semantic=None):
    """Triton 3.6: the Gluon builder has the TMA reduce but no Python name for it (3.8+: async_atomic_add)."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


@gluon.jit
def bulk_wait(lane, PENDING: gl.constexpr, READS_ONLY: gl.constexpr):
    # READS_ONLY: every bulk group's shared-memory reads done (the slot may be refilled); else at most
    # PENDING (0 or 1) groups still pending, their global writes included (a turn may be released:
    # no .read, FlashAttention issue #2244); then every lane of the warp past it
    gl.static_assert(PENDING == 0 or PENDING == 1, "bulk_wait: PENDING 0 or 1")
    gl.static_assert(PENDING == 0 or not READS_ONLY, "bulk_wait: READS_ONLY waits for every group")
    if READS_ONLY:
        asm: gl.constexpr = "cp.async.bulk.wait_group.read 0; bar.warp.sync -1; mov.u32 $0, 0;"
    elif PENDING == 0:
        asm: gl.constexpr = "cp.async.bulk.wait_group 0; fence.proxy.async.global; bar.warp.sync -1; mov.u32 $0, 0;"
    else:
        asm: gl.constexpr = "cp.async.bulk.wait_group 1; fence.proxy.async.global; bar.warp.sync -1; mov.u32 $0, 0;"
    gl.inline_asm_elementwise(asm, "=r,r", [lane], gl.int32, is_pure=False, pack=1)


@gluon.jit
def ld_acquire(ptrs):
    return gl.inline_asm_elementwise(
        "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptrs], gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def st_release(ptrs, values):
    # every lane stores the same value to the one counter; a store, not an atom: nothing returns
    gl.inline_asm_elementwise(
        "st.release.gpu.global.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r", [ptrs, values], gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def wait_turn(turns, j):
    # spin until every lane has acquired j from the counter (each reads the same one; it only grows,
    # and past j only after this program releases), then order the acquire before the async proxy's
    # bulk adds that follow
    seen = ld_acquire(turns)
    while gl.min(seen, 0) != j:
        seen = ld_acquire(turns)
    gl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.u32 $0, 0;", "=r,r", [seen], gl.int32, is_pure=False, pack=1
    )
