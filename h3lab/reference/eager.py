"""The block people run today, the reference point of every timing: eager bf16 torch, optionally TP.

diffusers' block math in plain torch ops (cuBLAS GEMMs, SDPA, autograd), no padding rows. With a
process group it is Megatron-style tensor parallelism: q/k/v and ff.net.0 column-parallel by head
and SwiGLU column, to_out and ff.net.2 row-parallel with NCCL's `all_reduce(SUM)` after them, the
input gradients of the column-parallel GEMMs all-reduced in the backward, AdaLN and the norms
replicated, and the q/k-norm weight gradients (each rank sees only its heads) all-reduced. Its
bits depend on the layout; that is the point of comparing against it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from h3lab.batch import PackedBatch
from h3lab.config import NUM_ADALN_CHUNKS
from h3lab.weights import BlockWeights

COLUMN_PARALLEL = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")


class _AllReduceForward(torch.autograd.Function):
    """Megatron's g: sum the row-parallel partials in the forward; the gradient passes through."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g


class _AllReduceBackward(torch.autograd.Function):
    """Megatron's f: the input of a column-parallel GEMM; its gradient partials are summed."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


def tp_shard(w: BlockWeights, rank: int, size: int) -> dict[str, Tensor]:
    """Rank `rank` of `size`'s slices: heads for q/k/v and to_out, SwiGLU columns for the FFN."""
    c = w.config
    if c.num_attention_heads % size or c.ffn_dim % size:
        raise ValueError(f"tp={size} must divide heads {c.num_attention_heads} and ffn_dim {c.ffn_dim}")
    A, Fd = c.inner_dim // size, c.ffn_dim // size
    rows_a, rows_f = slice(rank * A, (rank + 1) * A), slice(rank * Fd, (rank + 1) * Fd)
    p = dict(w.items())
    for name in COLUMN_PARALLEL:
        p[name] = p[name][rows_a]
    p["attn.to_out.0.weight"] = p["attn.to_out.0.weight"][:, rows_a]
    hidden, gate = p["ff.net.0.proj.weight"].chunk(2, 0)
    p["ff.net.0.proj.weight"] = torch.cat([hidden[rows_f], gate[rows_f]])
    p["ff.net.2.weight"] = p["ff.net.2.weight"][:, rows_f]
    return {k: v.contiguous() for k, v in p.items()}


def eager_block(
    w: BlockWeights, b: PackedBatch, cos: Tensor, sin: Tensor, backward: bool, *, shard: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """One eager block step; with `shard` (`tp_shard` of `w`), this rank's part of TP in the default group."""
    c, tp = w.config, shard is not None
    p = {k: v.detach().requires_grad_(backward) for k, v in (shard.items() if tp else w.items())}
    x = b.hidden_states.detach().requires_grad_(backward)
    temb = b.temb.detach().requires_grad_(backward)
    Dh, D = c.attention_head_dim, c.hidden_size
    f = _AllReduceBackward.apply if tp else (lambda t: t)
    g = _AllReduceForward.apply if tp else (lambda t: t)
    with torch.enable_grad() if backward else torch.no_grad():
        table = F.linear(F.silu(temb).to(torch.bfloat16), p["adaln_proj.linear.weight"], p["adaln_proj.linear.bias"])
        mods = [t.index_select(0, b.adaln_indices) for t in table.view(-1, NUM_ADALN_CHUNKS * D).chunk(6, -1)]
        sm, cm, gm, sf, cf, gf = mods
        n1 = f(F.rms_norm(x, (D,), p["norm1.weight"], c.norm_eps) * (1 + cm) + sm)
        q, k, v = (F.linear(n1, p[f"attn.to_{n}.weight"]).unflatten(-1, (-1, Dh)) for n in "qkv")
        q = F.rms_norm(q, (Dh,), p["attn.norm_q.weight"], c.qk_norm_eps)
        k = F.rms_norm(k, (Dh,), p["attn.norm_k.weight"], c.qk_norm_eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        o = o[0].transpose(0, 1).flatten(1)
        x1 = x + gm * g(F.linear(o, p["attn.to_out.0.weight"]))
        n2 = f(F.rms_norm(x1, (D,), p["norm2.weight"], c.norm_eps) * (1 + cf) + sf)
        hid, gate = F.linear(n2, p["ff.net.0.proj.weight"]).chunk(2, -1)
        out = x1 + gf * g(F.linear(hid * F.silu(gate), p["ff.net.2.weight"]))
        if not backward:
            return {"out": out}
        grads = torch.autograd.grad(out, [x, temb, *p.values()], b.grad_out)
    dw = dict(zip(p, grads[2:], strict=True))
    if tp:  # each rank saw only its heads' share of the q/k-norm weight gradients
        for name in ("attn.norm_q.weight", "attn.norm_k.weight"):
            dist.all_reduce(dw[name])
    return {"out": out.detach(), "dx": grads[0], "dtemb": grads[1], **{f"dw.{k}": t for k, t in dw.items()}}


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    C = cos.shape[-1]
    rotated = torch.cat([-t[..., C // 2 : C], t[..., : C // 2]], -1)
    return torch.cat([t[..., :C] * cos[:, None] + rotated * sin[:, None], t[..., C:]], -1)
