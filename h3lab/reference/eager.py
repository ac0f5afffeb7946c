"""The block people run today, the reference point of every timing: eager bf16 torch, optionally parallel.

diffusers' block math in plain torch ops (cuBLAS GEMMs, SDPA, autograd), no padding rows. With an
`EagerParallel` it runs one rank of a layout the way Megatron-LM and TorchTitan do:
- TP: q/k/v and ff.net.0 column-parallel by head and SwiGLU column, to_out and ff.net.2
  row-parallel; NCCL's `all_reduce(SUM)` after the row-parallel GEMMs (Megatron's g) and on the
  input gradient of the column-parallel ones (f); AdaLN and the norms replicated.
- SP (`+sp`): between the TP regions each TP rank holds 1/tp of the rows; f becomes an all-gather
  of rows (its backward a reduce-scatter), g a reduce-scatter (its backward an all-gather).
- CP: each CP group holds a contiguous 1/cp of the rows and all-gathers K and V over the CP ranks
  before attention (its backward reduce-scatters dK, dV), as TorchTitan's and xDiT's all-gather CP.
- The gradients every rank must hold whole: the q/k-norm weights' (each TP rank sees its heads) and,
  where rows are split, every replicated weight's and d temb (over the ranks splitting the rows) and
  the sharded weights' (over the CP ranks), one bucketed `all_reduce` per group and dtype, as DDP
  and Megatron reduce gradients.
Its bits depend on the layout; that is the point of comparing against it.

Dimension legend: R rows (local, TP or sequence), D hidden, H heads, Dh head_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from h3lab.batch import PackedBatch
from h3lab.config import NUM_ADALN_CHUNKS
from h3lab.weights import BlockWeights

COLUMN_PARALLEL = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")
SHARDED = (*COLUMN_PARALLEL, "attn.to_out.0.weight", "ff.net.0.proj.weight", "ff.net.2.weight")
HEAD_PARTIAL = ("attn.norm_q.weight", "attn.norm_k.weight")  # each TP rank sees only its heads' share


class EagerCollectives:
    """The torch.distributed calls of an eager layout, one method per kind: a benchmark subclasses it
    and overrides `call` to time each one. Every method returns a new or the given tensor."""

    def call(self, kind: str, site: str, group: Any, group_size: int, x: Tensor, fn: Callable[[], Tensor]) -> Tensor:
        """Run one collective (`fn`) of `kind` on `x` at `site`; the hook for timing."""
        return fn()

    def all_reduce(self, x: Tensor, group: Any, group_size: int, site: str) -> Tensor:
        def run() -> Tensor:
            dist.all_reduce(x, group=group)
            return x

        return self.call("all_reduce", site, group, group_size, x, run)

    def all_gather(self, x_R: Tensor, group: Any, group_size: int, site: str) -> Tensor:
        """Rows of every member, member order: [group_size * R, ...]."""

        def run() -> Tensor:
            out = x_R.new_empty((group_size * x_R.shape[0], *x_R.shape[1:]))
            dist.all_gather_into_tensor(out, x_R.contiguous(), group=group)
            return out

        return self.call("all_gather", site, group, group_size, x_R, run)

    def reduce_scatter(self, x_R: Tensor, group: Any, group_size: int, site: str) -> Tensor:
        """This member's 1/group_size of the rows of the members' sum."""

        def run() -> Tensor:
            out = x_R.new_empty((x_R.shape[0] // group_size, *x_R.shape[1:]))
            dist.reduce_scatter_tensor(out, x_R.contiguous(), group=group)
            return out

        return self.call("reduce_scatter", site, group, group_size, x_R, run)


@dataclass(frozen=True)
class EagerParallel:
    """This rank's groups in an eager layout (None: the default group; a size of 1: no group).

    `rows_group`: the ranks among which the rows are split (TP x CP under SP, else the CP group),
    over which the replicated weights' gradients are summed."""

    tp_group: Any = None
    tp_size: int = 1
    cp_group: Any = None
    cp_size: int = 1
    sp: bool = False
    rows_group: Any = None
    rows_size: int = 1
    ops: EagerCollectives = field(default_factory=EagerCollectives)

    def __post_init__(self) -> None:
        if self.sp and self.tp_size < 2:
            raise ValueError(f"sp with tp_size={self.tp_size}; allowed: tp_size >= 2")
        want = self.tp_size * self.cp_size if self.sp else self.cp_size
        if self.rows_size != want:
            raise ValueError(f"rows_size {self.rows_size}; allowed: {want} (tp*cp under SP, else cp)")


class _ToTP(torch.autograd.Function):
    """Megatron's f: into a column-parallel GEMM. TP: identity forward, all-reduce backward; SP:
    all-gather of the TP group's rows forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: Tensor, par: EagerParallel, site: str) -> Tensor:
        ctx.par, ctx.site = par, site
        return par.ops.all_gather(x, par.tp_group, par.tp_size, f"{site}.fwd") if par.sp else x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:
        par = ctx.par
        if par.sp:
            return par.ops.reduce_scatter(g, par.tp_group, par.tp_size, f"{ctx.site}.bwd"), None, None
        return par.ops.all_reduce(g.clone(), par.tp_group, par.tp_size, f"{ctx.site}.bwd"), None, None


class _FromTP(torch.autograd.Function):
    """Megatron's g: out of a row-parallel GEMM. TP: all-reduce forward, identity backward; SP:
    reduce-scatter to this rank's rows forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: Tensor, par: EagerParallel, site: str) -> Tensor:
        ctx.par, ctx.site = par, site
        if par.sp:
            return par.ops.reduce_scatter(x, par.tp_group, par.tp_size, site)
        return par.ops.all_reduce(x.clone(), par.tp_group, par.tp_size, site)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:
        par = ctx.par
        if par.sp:
            return par.ops.all_gather(g, par.tp_group, par.tp_size, f"{ctx.site}.bwd"), None, None
        return g, None, None


class _GatherCP(torch.autograd.Function):
    """K or V of every CP rank's rows: all-gather forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, par: EagerParallel, site: str) -> Tensor:
        ctx.par, ctx.site = par, site
        return par.ops.all_gather(x, par.cp_group, par.cp_size, site)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:
        par = ctx.par
        return par.ops.reduce_scatter(g, par.cp_group, par.cp_size, f"{ctx.site}.bwd"), None, None


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
    w: BlockWeights,
    b: PackedBatch,
    cos: Tensor,
    sin: Tensor,
    backward: bool,
    *,
    shard: dict[str, Tensor] | None = None,
    parallel: EagerParallel | None = None,
) -> dict[str, Tensor]:
    """One eager block step.

    Args:
        w: the whole block's weights (its config; the parameters unless `shard` is given).
        b: this rank's rows (under SP or CP its local rows, with their grad_out).
        cos, sin: RoPE tables of the rows q and k live on (the TP rows: the CP group's rows).
        backward: also return dx, d temb and every weight gradient.
        shard: `tp_shard(w, ...)` of this rank; alone, Megatron TP over the default group.
        parallel: this rank's groups (TP, SP, CP); needs `shard` when tp_size > 1.

    Returns:
        out (and dx, dtemb, dw.<name>) of this rank: its rows; sharded weights' gradients for its shard.

    Raises:
        ValueError: `parallel` with TP but no shard.
    """
    # the forward stays inline: its intermediates live until eager_block returns, as the measured
    # baseline's do (h3lab.bench.block_memory charges this function's allocations by source line)
    c, par = w.config, _parallel_of(shard, parallel)
    p = {k: v.detach().requires_grad_(backward) for k, v in (shard.items() if shard is not None else w.items())}
    x = b.hidden_states.detach().requires_grad_(backward)
    temb = b.temb.detach().requires_grad_(backward)
    Dh, D = c.attention_head_dim, c.hidden_size
    f, g, seq = _collectives(par)
    with torch.enable_grad() if backward else torch.no_grad():
        table = F.linear(F.silu(temb).to(torch.bfloat16), p["adaln_proj.linear.weight"], p["adaln_proj.linear.bias"])
        mods = [t.index_select(0, b.adaln_indices) for t in table.view(-1, NUM_ADALN_CHUNKS * D).chunk(6, -1)]
        sm, cm, gm, sf, cf, gf = mods
        n1 = f(F.rms_norm(x, (D,), p["norm1.weight"], c.norm_eps) * (1 + cm) + sm, "attn.qkv.dx")
        q, k, v = (F.linear(n1, p[f"attn.to_{n}.weight"]).unflatten(-1, (-1, Dh)) for n in "qkv")
        q = F.rms_norm(q, (Dh,), p["attn.norm_q.weight"], c.qk_norm_eps)
        k = F.rms_norm(k, (Dh,), p["attn.norm_k.weight"], c.qk_norm_eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = seq(k, "cp.gather.k"), seq(v, "cp.gather.v")
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        o = o[0].transpose(0, 1).flatten(1)
        x1 = x + gm * g(F.linear(o, p["attn.to_out.0.weight"]), "attn.to_out.0")
        n2 = f(F.rms_norm(x1, (D,), p["norm2.weight"], c.norm_eps) * (1 + cf) + sf, "ff.net.0.dx")
        hid, gate = F.linear(n2, p["ff.net.0.proj.weight"]).chunk(2, -1)
        out = x1 + gf * g(F.linear(hid * F.silu(gate), p["ff.net.2.weight"]), "ff.net.2")
        if not backward:
            return {"out": out}
        grads = torch.autograd.grad(out, [x, temb, *p.values()], b.grad_out)
    dw = dict(zip(p, grads[2:], strict=True))
    dtemb = grads[1]
    if par is not None:
        dtemb = _sync_grads(dw, dtemb, par)
    return {"out": out.detach(), "dx": grads[0], "dtemb": dtemb, **{f"dw.{k}": t for k, t in dw.items()}}


def _parallel_of(shard: dict[str, Tensor] | None, parallel: EagerParallel | None) -> EagerParallel | None:
    """`parallel`; a shard alone means Megatron TP over the default group; TP without a shard is a ValueError."""
    if parallel is None and shard is not None:
        parallel = EagerParallel(tp_size=dist.get_world_size())
    if parallel is not None and parallel.tp_size > 1 and shard is None:
        raise ValueError(f"tp_size={parallel.tp_size} needs this rank's tp_shard; allowed: shard=tp_shard(...)")
    return parallel


_Collective = Callable[[Tensor, str], Tensor]


def _collectives(par: EagerParallel | None) -> tuple[_Collective, _Collective, _Collective]:
    """(f, g, seq) of `par`: Megatron's f and g under TP, the K/V all-gather under CP; each the identity
    where `par` splits nothing."""
    tp, cp = par is not None and par.tp_size > 1, par is not None and par.cp_size > 1
    f = (lambda t, site: _ToTP.apply(t, par, site)) if tp else (lambda t, site: t)
    g = (lambda t, site: _FromTP.apply(t, par, site)) if tp else (lambda t, site: t)
    seq = (lambda t, site: _GatherCP.apply(t, par, site)) if cp else (lambda t, site: t)
    return f, g, seq


def _sync_grads(dw: dict[str, Tensor], dtemb: Tensor, par: EagerParallel) -> Tensor:
    """Sum the partial gradients in place (see the module doc); returns the whole d temb."""
    rows_split = par.rows_size > 1
    if par.tp_size > 1 and not (par.sp and rows_split):  # under SP the rows group covers the TP ranks too
        _bucket_all_reduce([dw[n] for n in HEAD_PARTIAL], par, par.tp_group, par.tp_size, "grad_sync.tp")
    if rows_split:
        replicated = [t for n, t in dw.items() if n not in SHARDED]
        dtemb = dtemb.clone()
        _bucket_all_reduce([*replicated, dtemb], par, par.rows_group, par.rows_size, "grad_sync.rows")
    if par.cp_size > 1:
        _bucket_all_reduce([dw[n] for n in SHARDED], par, par.cp_group, par.cp_size, "grad_sync.cp")
    return dtemb


def _bucket_all_reduce(grads: list[Tensor], par: EagerParallel, group: Any, size: int, site: str) -> None:
    """One all_reduce per dtype over the flattened `grads`, copied back into them."""
    for dtype in sorted({t.dtype for t in grads}, key=str):
        same = [t for t in grads if t.dtype == dtype]
        flat = par.ops.all_reduce(torch.cat([t.reshape(-1) for t in same]), group, size, f"{site}.{dtype}")
        for t, piece in zip(same, flat.split([t.numel() for t in same]), strict=True):
            t.copy_(piece.view_as(t))


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    C = cos.shape[-1]
    rotated = torch.cat([-t[..., C // 2 : C], t[..., : C // 2]], -1)
    return torch.cat([t[..., :C] * cos[:, None] + rotated * sin[:, None], t[..., C:]], -1)
