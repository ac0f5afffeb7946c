"""RMSNorm + AdaLN modulation and per-head q/k RMSNorm + RoPE as Triton kernels, forward and backward.

Reference: h3lab.ops.norm, with the same math and the same operation order, so the results are the
reference's bits, not just close to them:
- a row's sums (sum of squares, the dot of the backward) are the reference's `pair_sum` tree,
  built from exact halvings of the tile (`_pair_sum`), not `tl.sum`, whose tree follows the
  thread layout; so the bits depend on neither num_warps nor the rows a program holds;
- a mean is the sum times 1/n rounded to fp32 (`_mean` of the reference: `inv_n` = 1.0 / n in
  Python, rounded to fp32 when passed), and 1/sqrt is IEEE (`div_rn`, `sqrt_rn`: Triton's `/` on
  fp32 is `div.full`, 2 ULP);
- kernels launch with `enable_fp_fusion=False`: a fused multiply-add rounds once where the
  reference (separate torch ops) rounds twice.
One program holds whole rows: the row tile is next_power_of_two(width) wide, padded with +0 as
`pair_sum` pads, so no row's bits depend on R or on which rows share the call.

The kernels' sqrt is correctly rounded, as the contract says; the reference's torch.sqrt is on
CUDA but not on CPU (torch 2.13 + MKL: some float32 inputs 1 ULP off). Against the reference
run with a correctly rounded sqrt, the bits are equal (tests/test_kernels_rowlocal.py).

Dimension legend: R rows, D hidden, H heads, Dh head_dim, C rotated channels (cos.shape[-1]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.config import H3Config
from h3lab.triton import configs
from h3lab.triton.variant import Variant, options

F32 = torch.float32
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _pair_sum(x, M: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr):
    """Row sums of x [M, N] (N = 2^LOG2_N) as `pair_sum`: each level adds column j to column j + n/2."""
    for i in tl.static_range(1, LOG2_N + 1):
        # [M, 2, n/2]: index 0 holds columns [0, n/2), index 1 columns [n/2, n); the size-2 sum is one add
        x = tl.sum(tl.reshape(x, (M, 2, N >> i)), axis=1)
    return tl.reshape(x, (M,))


@triton.jit
def _rstd(sum_sq, inv_n, eps):
    # 1 / sqrt(sum * (1/n) + eps), each step correctly rounded, as `_rstd` of h3lab.ops.norm
    return tl.div_rn(1.0, tl.sqrt_rn(sum_sq * inv_n + eps))


@triton.jit
def _rms_modulate_kernel(
    inputs,
    outputs,
    R,
    strides,
    inv_d,
    eps,
    BACKWARD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LOG2_D: tl.constexpr,
):
    # inputs (x, w, scale, other), other = shift (forward) or dm (backward); outputs (out, dw, dscale,
    # dshift): the backward's four are FP32 [R, D] contiguous, the forward writes out only; row strides
    # (x, scale, other, out)
    x_ptr, w_ptr, scale_ptr, other_ptr = inputs
    out_ptr, dw_ptr, dscale_ptr, dshift_ptr = outputs
    sx, sscale, sother, sout = strides
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)[:, None]  # 65536 rows x the table's 6*5376 row stride passes 2^31
    c = cols[None, :]
    x = tl.load(x_ptr + r64 * sx + c, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + r64 * sscale + c, mask=mask, other=0.0).to(tl.float32)
    other = tl.load(other_ptr + r64 * sother + c, mask=mask, other=0.0).to(tl.float32)
    rstd = _rstd(_pair_sum(x * x, BLOCK_R, BLOCK_D, LOG2_D), inv_d, eps)[:, None]
    xhat = x * rstd
    if BACKWARD:
        dscale = other * (xhat * w)
        dn = other * (1.0 + scale)
        dxhat = dn * w
        mean = _pair_sum(dxhat * xhat, BLOCK_R, BLOCK_D, LOG2_D) * inv_d
        dx = rstd * (dxhat - xhat * mean[:, None])
        tl.store(out_ptr + r64 * sout + c, dx, mask=mask)
        tl.store(dw_ptr + r64 * sout + c, dn * xhat, mask=mask)
        tl.store(dscale_ptr + r64 * sout + c, dscale, mask=mask)
        tl.store(dshift_ptr + r64 * sout + c, other, mask=mask)
    else:
        out = (xhat * w) * (1.0 + scale) + other
        tl.store(out_ptr + r64 * sout + c, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    inputs,
    outputs,
    H,
    strides,
    inv_dh,
    eps,
    BACKWARD: tl.constexpr,
    DH: tl.constexpr,
    C: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    LOG2_DH: tl.constexpr,
):
    # inputs (q, w, cos, sin, dout), outputs (out, dw: contiguous [R, H, Dh]); strides: q's and dout's
    # (row, head), the tables' rows
    q_ptr, w_ptr, cos_ptr, sin_ptr, dout_ptr = inputs
    out_ptr, dw_ptr = outputs
    sq_r, sq_h, sd_r, sd_h, scos, ssin = strides
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ch = tl.arange(0, BLOCK_DH)
    cmask = ch < DH
    mask = (heads < H)[:, None] & cmask[None, :]
    first = ch < C // 2  # rotate_half pairs channel i with i + C/2 (first half) or i - C/2 (second half)
    rot = ch < C
    partner = tl.where(first, ch + C // 2, tl.where(rot, ch - C // 2, ch))
    h64 = heads.to(tl.int64)[:, None]
    q = tl.load(q_ptr + r * sq_r + h64 * sq_h + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    cos = tl.load(cos_ptr + r * scos + ch, mask=rot, other=0.0)[None, :]
    rstd = _rstd(_pair_sum(q * q, BLOCK_H, BLOCK_DH, LOG2_DH), inv_dh, eps)[:, None]
    o = r * H * DH + h64 * DH + ch[None, :]  # outputs are contiguous [R, H, Dh]
    if BACKWARD:
        dout = tl.load(dout_ptr + r * sd_r + h64 * sd_h + ch[None, :], mask=mask, other=0.0).to(tl.float32)
        dout_p = tl.load(dout_ptr + r * sd_r + h64 * sd_h + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        sin_p = tl.load(sin_ptr + r * ssin + partner, mask=rot, other=0.0)[None, :]
        y_p = dout_p * sin_p  # (dout * sin) at the partner; _rotate_half_t = [y2, -y1]
        dqn = tl.where(rot[None, :], dout * cos + tl.where(first[None, :], y_p, -y_p), dout)
        qhat = q * rstd
        dqhat = dqn * w
        mean = _pair_sum(dqhat * qhat, BLOCK_H, BLOCK_DH, LOG2_DH) * inv_dh
        dq = rstd * (dqhat - qhat * mean[:, None])
        tl.store(out_ptr + o, dq.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + o, dqn * qhat, mask=mask)
    else:
        q_p = tl.load(q_ptr + r * sq_r + h64 * sq_h + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        w_p = tl.load(w_ptr + partner, mask=cmask, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + r * ssin + ch, mask=rot, other=0.0)[None, :]
        qn = (q * rstd) * w
        qn_p = (q_p * rstd) * w_p  # the same operations on the partner's operands: its qn, bit for bit
        rotated = qn * cos + tl.where(first[None, :], -qn_p, qn_p) * sin  # _rotate_half = [-x2, x1]
        tl.store(out_ptr + o, tl.where(rot[None, :], rotated, qn).to(out_ptr.dtype.element_ty), mask=mask)


def _inner(t: Tensor, name: str, dims: int) -> Tensor:
    """`t` with unit stride on its last axis (the table's scale/shift rows keep their row stride)."""
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in IN_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} not supported; allowed: {list(IN_DTYPES)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(out_dtype: torch.dtype, *tensors: Tensor) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} not supported; allowed: {list(OUT_DTYPES)}")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"operands on {sorted(map(str, devices))}; allowed: one device")
    device = devices.pop()
    if device.type != "cuda" and not configs.interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors, got {device}; allowed: cuda (or TRITON_INTERPRET=1)")


def _node(node: str | None, device: torch.device) -> str:
    return node if node is not None else configs.node_of(device)


def _rms_modulate(x, w, scale, shift, dm, eps, out_dtype, node) -> list[Tensor]:
    backward = dm is not None
    x, w, scale = _inner(x, "x", 2), _inner(w, "w", 1), _inner(scale, "scale", 2)
    other = _inner(dm, "dm", 2) if backward else _inner(shift, "shift", 2)
    R, D = x.shape
    if w.shape != (D,) or scale.shape != (R, D) or other.shape != (R, D):
        shapes = [tuple(t.shape) for t in (x, w, scale, other)]
        raise ValueError(f"rms_modulate: shapes {shapes}; allowed: x, scale, shift/dm [R, D] and w [D]")
    cfg = configs.pinned("norm", _node(node, x.device))["rms_modulate_bwd" if backward else "rms_modulate_fwd"]
    block_d = triton.next_power_of_2(D)
    if block_d > cfg["max_width"]:
        raise ValueError(f"rms_modulate: D={D} pads to {block_d}; allowed: D <= {cfg['max_width']} (pinned)")
    outs = [torch.empty((R, D), dtype=out_dtype, device=x.device) for _ in range(4 if backward else 1)]
    if R:
        ptrs = outs if backward else outs * 4  # the forward never touches the last three
        _rms_modulate_kernel[(configs.cdiv(R, cfg["rows_per_program"]),)](
            (x, w, scale, other),
            tuple(ptrs),
            R,
            (x.stride(0), scale.stride(0), other.stride(0), D),
            1.0 / D,  # the reference's `* (1.0 / n)`: a Python double, rounded to fp32 as torch does
            eps,
            BACKWARD=backward,
            D=D,
            BLOCK_R=cfg["rows_per_program"],
            BLOCK_D=block_d,
            LOG2_D=block_d.bit_length() - 1,
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,
        )
    return outs


def rms_modulate_fwd(
    x_RD: Tensor,
    w_D: Tensor,
    scale_RD: Tensor,
    shift_RD: Tensor,
    eps: float,
    out_dtype: torch.dtype,
    *,
    node: str | None = None,
) -> Tensor:
    """rmsnorm(x) * w * (1 + scale) + shift rounded once to `out_dtype` [R, D]; scale/shift may be strided rows."""
    _check(out_dtype, x_RD, w_D, scale_RD, shift_RD)
    return _rms_modulate(x_RD, w_D, scale_RD, shift_RD, None, eps, out_dtype, node)[0]


def rms_modulate_bwd(
    dm_RD: Tensor, x_RD: Tensor, w_D: Tensor, scale_RD: Tensor, eps: float, *, node: str | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of `rms_modulate_fwd`: FP32 (dx, dw per row, dscale, dshift) [R, D] each."""
    _check(F32, dm_RD, x_RD, w_D, scale_RD)
    dx, dw_rows, dscale, dshift = _rms_modulate(x_RD, w_D, scale_RD, None, dm_RD, eps, F32, node)
    return dx, dw_rows, dscale, dshift


def _qk_norm_rope(q, w, cos, sin, dout, eps, out_dtype, node) -> tuple[Tensor, Tensor]:
    backward = dout is not None
    if cos.dtype != F32 or sin.dtype != F32:
        raise ValueError(f"qk_norm_rope: cos/sin are {cos.dtype}/{sin.dtype}; allowed: torch.float32 tables")
    q, w, cos, sin = _inner(q, "q", 3), _inner(w, "w", 1), _inner(cos, "cos", 2), _inner(sin, "sin", 2)
    dout = _inner(dout, "dout", 3) if backward else q  # the forward never reads it
    R, H, Dh = q.shape
    C = cos.shape[-1]
    if w.shape != (Dh,) or cos.shape != (R, C) or sin.shape != (R, C) or dout.shape != q.shape:
        shapes = [tuple(t.shape) for t in (q, w, cos, sin, dout)]
        raise ValueError(f"qk_norm_rope: shapes {shapes}; allowed: q, dout [R, H, Dh], w [Dh], cos, sin [R, C]")
    if C % 2 or Dh < C:
        raise ValueError(f"qk_norm_rope: C={C} rotated channels; allowed: even C <= head_dim {Dh}")
    cfg = configs.pinned("norm", _node(node, q.device))["qk_norm_rope"]
    block_dh = triton.next_power_of_2(Dh)
    if block_dh > cfg["max_head_dim"]:
        raise ValueError(f"qk_norm_rope: head_dim {Dh} pads to {block_dh}; allowed: <= {cfg['max_head_dim']}")
    out = torch.empty((R, H, Dh), dtype=out_dtype, device=q.device)
    dw = torch.empty((R, H, Dh), dtype=F32, device=q.device) if backward else out
    if R and H:
        block_h = min(cfg["heads_per_program"], triton.next_power_of_2(H))
        _qk_norm_rope_kernel[(R, configs.cdiv(H, block_h))](
            (q, w, cos, sin, dout),
            (out, dw),
            H,
            (q.stride(0), q.stride(1), dout.stride(0), dout.stride(1), cos.stride(0), sin.stride(0)),
            1.0 / Dh,
            eps,
            BACKWARD=backward,
            DH=Dh,
            C=C,
            BLOCK_H=block_h,
            BLOCK_DH=block_dh,
            LOG2_DH=block_dh.bit_length() - 1,
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,
        )
    return out, dw


def qk_norm_rope_fwd(
    q_RHD: Tensor,
    w_D: Tensor,
    cos_RC: Tensor,
    sin_RC: Tensor,
    eps: float,
    out_dtype: torch.dtype,
    *,
    node: str | None = None,
) -> Tensor:
    """Per-head RMSNorm over head_dim, then rotate-half RoPE on the first C channels: [R, H, Dh] out_dtype."""
    _check(out_dtype, q_RHD, w_D, cos_RC, sin_RC)
    return _qk_norm_rope(q_RHD, w_D, cos_RC, sin_RC, None, eps, out_dtype, node)[0]


def qk_norm_rope_bwd(
    dout_RHD: Tensor,
    q_RHD: Tensor,
    w_D: Tensor,
    cos_RC: Tensor,
    sin_RC: Tensor,
    eps: float,
    out_dtype: torch.dtype,
    *,
    node: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Backward of `qk_norm_rope_fwd`: (dq [R, H, Dh] out_dtype, dw per (row, head) [R, H, Dh] FP32)."""
    _check(out_dtype, dout_RHD, q_RHD, w_D, cos_RC, sin_RC)
    return _qk_norm_rope(q_RHD, w_D, cos_RC, sin_RC, dout_RHD, eps, out_dtype, node)


def variants(node: str) -> list[Variant]:
    """Both kernels in both directions at the real widths (hidden, head_dim, rotated channels)."""
    real = H3Config.real()
    D, dh, C = real.hidden_size, real.attention_head_dim, 6 * real.rope_freq_dim
    pins = configs.pinned("norm", node)
    out = []
    for backward, entry in ((False, "rms_modulate_fwd"), (True, "rms_modulate_bwd")):
        cfg = pins[entry]
        block_d = triton.next_power_of_2(D)
        o = "*fp32" if backward else "*bf16"
        types = {"inputs": ("*bf16", "*fp32", "*fp32", "*fp32"), "outputs": (o,) * 4, "strides": ("i32",) * 4}
        types |= {"inv_d": "fp32", "eps": "fp32"}
        const = {"BACKWARD": backward, "D": D, "BLOCK_R": cfg["rows_per_program"], "BLOCK_D": block_d}
        const |= {"LOG2_D": block_d.bit_length() - 1}
        out.append(Variant("norm", entry, _rms_modulate_kernel, types, const, options(cfg, stages=False)))
    cfg = pins["qk_norm_rope"]
    for backward in (False, True):
        types = {"inputs": ("*bf16", "*fp32", "*fp32", "*fp32", "*bf16"), "outputs": ("*bf16", "*fp32")}
        types |= {"strides": ("i32",) * 6, "inv_dh": "fp32", "eps": "fp32"}
        const = {"BACKWARD": backward, "DH": dh, "C": C, "BLOCK_H": min(cfg["heads_per_program"], 64)}
        const |= {"BLOCK_DH": dh, "LOG2_DH": dh.bit_length() - 1}
        what = f"qk_norm_rope {'bwd' if backward else 'fwd'}"
        out.append(Variant("norm", what, _qk_norm_rope_kernel, types, const, options(cfg, stages=False)))
    return out
