"""AdamW's update of many pieces and their write-back, one Triton launch per group of like pieces.

Reference: h3lab.ops.adamw.adamw_updates, bit for bit: per element the same IEEE FP32 operations in
the same order (launched with `enable_fp_fusion=False`, so no multiply-add is contracted; division
and square root through `div_rn` and `sqrt_rn`, correctly rounded, not the approximate defaults),
and the weight rounded to bf16 by the reference's integer round-half-to-even (h3lab.ops.fixed.round_to),
so the bytes do not depend on a conversion instruction. An element's result depends on its own
operands only, never on the tile or on which program updates it, so one launch covers every piece
of a group alike in gradient dtype, weight dtype, layout (contiguous or strided) and alignment (at
most eight launches): a table of their addresses, sizes and strides, each program finding its
piece by a binary search over the programs' starts (as h3lab.triton.squares), where one launch per
piece cost a model's update hundreds of launches. A program updates one tile of its piece: a piece
whose gradient and weight are contiguous is read as one row, others as [R, C] through their
strides (a unit's columns); no element pays an integer division. Pieces whose addresses, sizes and
row strides the launcher finds aligned take a build with alignment hints (vectorised loads and
stores). The reference reads and writes each piece about seventeen times (one torch op each); this
reads the gradient and the state once and writes the state and the weight once. It also says, per
piece, whether a weight it wrote is NaN or Inf (the stored bits: a bf16 that overflowed included),
so the optimizer's check needs no second pass over the weights.

Launcher: `adamw_updates`. Dimension legend: R rows, C columns of a piece viewed as 2-D.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.host import to_device
from h3lab.ops.adamw import ADAMW_SCALARS, AdamWPiece
from h3lab.triton import configs
from h3lab.triton.gemm_host import check_device
from h3lab.triton.tables import program_tensor, search_steps
from h3lab.triton.variant import Variant, options

F32 = torch.float32
GRAD_DTYPES = (torch.bfloat16, torch.float32)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _round_bf16_bits(x):
    # h3lab.ops.fixed._round_bits: round half to even on the dropped 16 bits; NaN -> quiet NaN, sign kept
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0 | ((u >> 16) & 0x8000), r)
    return (r - ((r & 0x8000) << 1)).to(tl.int16)


# one int64 row per piece: its tensors' addresses, its rows and columns as the kernel reads it, the
# gradient's and the weight's strides, its index k among the launcher's pieces (where its flag
# goes) and its tiles per row of tiles
TABLE = ("master", "m", "v", "g", "w", "R", "C", "s_gr", "s_gc", "s_wr", "s_wc", "k", "tiles_c")


# One function on purpose: a jit kernel; one element's IEEE operations in the reference's order, read
# from its piece's table row, and a signature fixed by the launcher and its builds.
@triton.jit
def adamw_kernel(
    table_ptr,
    starts_ptr,
    coef_ptr,
    s_ptr,
    go_ptr,
    bad_ptr,
    T,
    G_DTYPE: tl.constexpr,
    W_BF16: tl.constexpr,
    SEARCH: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # piece t's programs are [starts[t], starts[t + 1]); its table row (TABLE) says where its state,
    # gradient and weight are; each program updates one TILE_R x TILE_C tile of the piece viewed as
    # [R, C] (the state contiguous, the gradient and the weight through their strides: no integer
    # division per element) and sets bad[k] = 1 where a weight it wrote is NaN or Inf (every such
    # store writes 1: no race); go[0] == 0 masks every load and store: nothing changes, no flag is set
    lo, q = program_tensor(starts_ptr, T, SEARCH)  # q: this program's tile of the piece
    row = table_ptr + lo * 13
    master_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 3).to(tl.pointer_type(G_DTYPE))
    w_ptr = tl.load(row + 4).to(tl.pointer_type(tl.int16 if W_BF16 else tl.float32))
    R, C, s_gr, s_gc = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7), tl.load(row + 8)
    s_wr, s_wc, tiles_c = tl.load(row + 9), tl.load(row + 10), tl.load(row + 12)
    if ALIGNED:  # the launcher checked: 16-byte aligned addresses, row strides multiples of 8, columns contiguous
        master_ptr, m_ptr, v_ptr = tl.multiple_of(master_ptr, 16), tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
        g_ptr, w_ptr = tl.multiple_of(g_ptr, 16), tl.multiple_of(w_ptr, 16)
        C, s_gr, s_wr = tl.multiple_of(C, 8), tl.multiple_of(s_gr, 8), tl.multiple_of(s_wr, 8)
    live = tl.load(go_ptr).to(tl.int64)  # 1: update; 0: every mask below is empty
    if TILE_R == 1:  # one row (contiguous: element i at offset i everywhere)
        i = q * TILE_C + tl.arange(0, TILE_C)
        mask = i < C * live
        g_off, w_off = i, i
    else:
        r = (q // tiles_c) * TILE_R + tl.arange(0, TILE_R)[:, None]
        c = (q % tiles_c) * TILE_C + tl.arange(0, TILE_C)[None, :]
        mask = (r < R * live) & (c < C)
        i = r * C + c
        if ALIGNED:  # columns back to back too (the launcher checked)
            g_off, w_off = r * s_gr + c, r * s_wr + c
        else:
            g_off, w_off = r * s_gr + c * s_gc, r * s_wr + c * s_wc
    # the scalars in h3lab.ops.adamw.ADAMW_SCALARS order
    decay, beta1, omb1 = tl.load(s_ptr + 0), tl.load(s_ptr + 1), tl.load(s_ptr + 2)
    beta2, omb2, bias2_sqrt = tl.load(s_ptr + 3), tl.load(s_ptr + 4), tl.load(s_ptr + 5)
    step_size, eps = tl.load(s_ptr + 6), tl.load(s_ptr + 7)
    g = tl.load(g_ptr + g_off, mask=mask, other=0.0).to(tl.float32) * tl.load(coef_ptr)
    m = tl.load(m_ptr + i, mask=mask, other=0.0) * beta1 + g * omb1
    v = tl.load(v_ptr + i, mask=mask, other=0.0) * beta2 + (g * g) * omb2
    w = tl.load(master_ptr + i, mask=mask, other=0.0) * decay
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    w = w - tl.div_rn(m, denom) * step_size
    tl.store(m_ptr + i, m, mask=mask)
    tl.store(v_ptr + i, v, mask=mask)
    tl.store(master_ptr + i, w, mask=mask)
    if W_BF16:
        bits = _round_bf16_bits(w)
        tl.store(w_ptr + w_off, bits, mask=mask)
        nonfinite = (bits & 0x7F80) == 0x7F80  # the stored bf16's exponent all ones: Inf or NaN
    else:
        tl.store(w_ptr + w_off, w, mask=mask)
        nonfinite = (w != w) | (tl.abs(w) == float("inf"))
    bad = tl.max(tl.reshape((nonfinite & mask).to(tl.int32), [TILE_R * TILE_C]), axis=0)
    tl.store(bad_ptr + tl.load(row + 11), bad.to(tl.int8), mask=bad > 0)


def _as_2d(t: Tensor) -> Tensor:
    return t.reshape(1, -1) if t.dim() < 2 else t  # a 1-D view stays a view


def _check_piece(k: int, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, weight: Tensor) -> None:
    shape, at = master.shape, f"adamw_updates: piece {k}:"
    if master.dim() > 2:
        raise ValueError(f"{at} a {master.dim()}-D piece {list(shape)}; allowed: 0-, 1- or 2-D")
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not t.is_contiguous() or t.shape != shape or t.dtype != F32:
            raise ValueError(
                f"{at} {name} is {t.dtype} {list(t.shape)} strides {t.stride()}; allowed: contiguous torch.float32 "
                f"{list(shape)}"
            )
    for name, t, dtypes in (("grad", grad, GRAD_DTYPES), ("weight", weight, WEIGHT_DTYPES)):
        if t.shape != shape or t.dtype not in dtypes:
            raise ValueError(f"{at} {name} is {t.dtype} {list(t.shape)}; allowed: {list(dtypes)}, {list(shape)}")


def adamw_updates(
    pieces: Sequence[AdamWPiece], coef: Tensor, s: Tensor, go: Tensor | None = None, *, node: str | None = None
) -> Tensor:
    """h3lab.ops.adamw.adamw_updates in one launch per group of like pieces (module docstring): the
    same arguments, the same bytes, the same [P] bool of pieces left NaN or Inf; `go` (0-d bool,
    None: true) is read by the kernels, never by the host: false, and nothing changes.

    Each piece is (master, exp_avg, exp_avg_sq, grad, weight): the first three contiguous FP32 of
    the piece's shape (0-, 1- or 2-D); `grad` and `weight` of that shape with any strides (a unit's
    columns), bf16 or fp32. `coef`: 0-d FP32; `s`: contiguous FP32 [len(ADAMW_SCALARS)].

    Raises:
        ValueError: shapes, dtypes, devices or layouts other than those above.
    """
    for k, piece in enumerate(pieces):
        _check_piece(k, *piece)
    if coef.numel() != 1 or coef.dtype != F32 or s.shape != (len(ADAMW_SCALARS),) or s.dtype != F32:
        raise ValueError(
            f"adamw_updates: coef {coef.dtype} {list(coef.shape)}, s {s.dtype} {list(s.shape)}; allowed: a 0-d "
            f"torch.float32 and torch.float32 [{len(ADAMW_SCALARS)}] ({', '.join(ADAMW_SCALARS)})"
        )
    if not s.is_contiguous():
        raise ValueError(f"adamw_updates: s has strides {s.stride()}; allowed: contiguous")
    if go is not None and (go.shape != () or go.dtype != torch.bool):
        raise ValueError(f"adamw_updates: go {go.dtype} {list(go.shape)}; allowed: a 0-d torch.bool")
    device = check_device(
        "adamw_updates", coef, s, *([] if go is None else [go]), *(t for piece in pieces for t in piece)
    )
    go_i8 = (torch.ones(1, dtype=torch.bool, device=device) if go is None else go.reshape(1)).view(torch.int8)
    bad = torch.zeros(len(pieces), dtype=torch.int8, device=device)
    cfg = configs.pinned("adamw", node or configs.node_of(device))
    groups: dict[tuple[torch.dtype, torch.dtype, bool, bool], list[tuple[int, Tensor, Tensor]]] = {}
    for k, (master, m, v, grad, weight) in enumerate(pieces):
        if master.numel():
            flat, g2, w2 = _read_as(grad, weight)
            aligned = _aligned((master, m, v, g2, w2), flat)
            groups.setdefault((grad.dtype, weight.dtype, flat, aligned), []).append((k, g2, w2))
    for (g_dtype, w_dtype, flat, aligned), members in groups.items():
        _launch(pieces, members, (coef, s, go_i8, bad), g_dtype, w_dtype == torch.bfloat16, flat, aligned, cfg)
    return bad.bool()


def _read_as(grad: Tensor, weight: Tensor) -> tuple[bool, Tensor, Tensor]:
    """(flat, the gradient and the weight as the kernel reads them): both contiguous, one row (wide
    tiles); otherwise [R, C] through their strides."""
    if grad.is_contiguous() and weight.is_contiguous():
        return True, grad.reshape(1, -1), weight.reshape(1, -1)
    return False, _as_2d(grad), _as_2d(weight)


def _aligned(read: AdamWPiece, flat: bool) -> bool:
    """Whether a piece, read as `_read_as` gives it (master, exp_avg, exp_avg_sq, grad, weight), may
    take the vectorised build, whose hints must hold (a false one reads and writes past the piece):
    every address 16-byte aligned; read as one row, its size a multiple of 8; read as [R, C] tiles,
    C and both row strides multiples of 8 elements, columns back to back."""
    if any(t.data_ptr() % 16 for t in read):
        return False
    if flat:  # its mask i < n is then uniform over every vector of 8
        return read[0].numel() % 8 == 0
    g2, w2 = read[3], read[4]
    return g2.shape[1] % 8 == 0 and g2.stride(1) == w2.stride(1) == 1 and g2.stride(0) % 8 == w2.stride(0) % 8 == 0


def _launch(
    pieces: Sequence[AdamWPiece],
    members: list[tuple[int, Tensor, Tensor]],
    scalars: tuple[Tensor, Tensor, Tensor, Tensor],
    g_dtype: torch.dtype,
    w_bf16: bool,
    flat: bool,
    aligned: bool,
    cfg: dict,
) -> None:
    """One launch over `members` (piece k with its gradient and weight as `_read_as` gives them; one
    gradient dtype, one weight dtype, one layout, one alignment): contiguous ones (`flat`) as one
    row in tiles of 1 x BLOCK, the others [R, C] in tiles of BLOCK / TILE_C x TILE_C; `aligned`: the
    hinted build (`_aligned` holds for each); `scalars`: (coef, s, go as int8 [1], the flags bad)."""
    coef, s, go, bad = scalars
    tile_c = cfg["BLOCK"] if flat else cfg["TILE_C"]
    rows, starts = [], [0]
    for k, g2, w2 in members:
        master, m, v = pieces[k][:3]
        w_store = w2.view(torch.int16) if w_bf16 else w2  # the rounded bits are stored as integers
        R, C = g2.shape
        tiles_c = configs.cdiv(C, tile_c)
        addresses = [master.data_ptr(), m.data_ptr(), v.data_ptr(), g2.data_ptr(), w_store.data_ptr()]
        strides = [g2.stride(0), g2.stride(1), w_store.stride(0), w_store.stride(1)]
        rows.append([*addresses, R, C, *strides, k, tiles_c])
        starts.append(starts[-1] + configs.cdiv(R, cfg["BLOCK"] // tile_c) * tiles_c)
    table, programs = to_device(rows, torch.int64, s.device), to_device(starts, torch.int64, s.device)
    adamw_kernel[(starts[-1],)](
        table,
        programs,
        coef,
        s,
        go,
        bad,
        len(members),
        G_DTYPE=tl.bfloat16 if g_dtype == torch.bfloat16 else tl.float32,
        W_BF16=w_bf16,
        SEARCH=search_steps(len(members)),
        TILE_R=cfg["BLOCK"] // tile_c,
        TILE_C=tile_c,
        ALIGNED=aligned,
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )
    # the reshaped views lived until the launch was queued; the tensors they view are the caller's


def variants(node: str) -> list[Variant]:
    """The update of bf16 weights with bf16 gradients (written as bits) and of FP32 weights with FP32
    gradients, each contiguous (one row) and strided ([R, C] tiles), aligned (vectorised) or not; a
    model's ~350 pieces: SEARCH 9."""
    cfg = configs.pinned("adamw", node)
    types = {"table_ptr": "*i64", "starts_ptr": "*i64", "coef_ptr": "*fp32", "s_ptr": "*fp32", "go_ptr": "*i8"}
    types["bad_ptr"] = "*i8"
    out = []
    for w_bf16, g_dtype in ((True, tl.bfloat16), (False, tl.float32)):
        for flat in (True, False):
            for aligned in (True, False):
                tile_c = cfg["BLOCK"] if flat else cfg["TILE_C"]
                const = {"G_DTYPE": g_dtype, "W_BF16": w_bf16, "SEARCH": 9, "ALIGNED": aligned}
                const |= {"TILE_R": cfg["BLOCK"] // tile_c, "TILE_C": tile_c}
                what = f"{'bf16' if w_bf16 else 'fp32'} weights, {'contiguous' if flat else 'strided'}"
                what += ", aligned" if aligned else ""
                out.append(Variant("adamw", what, adamw_kernel, types, const, options(cfg, stages=False)))
    return out
