"""The canonical MiniMax-H3 block: forward, input gradient and every weight gradient, written out.

Dimension legend: R rows (local / TP / sequence row spaces, see h3lab.comm), D hidden, A attention
width, F SwiGLU width, E time_embed_dim, T timesteps, H heads, Dh head_dim; `_u` = one canonical
unit. The math is diffusers' `MiniMaxH3TransformerBlock`; the arithmetic follows h3lab.contract:
FP32 inside every op, one rounding (`R`) at its output, unit partials + the 8-unit tree wherever a
reduction crosses units, logical-key order wherever it crosses rows. The backward is explicit, so
no autograd kernel choice can change an order. `block_step` is the one implementation; layouts
drive it through a `BlockComm` and a `UnitWeights` slice, `canonical_block` with neither.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend, get_backend
from h3lab.batch import PackedBatch
from h3lab.comm import BlockComm, LocalComm
from h3lab.contract import check_device, strict_mode
from h3lab.ops import attention as att
from h3lab.ops.ffn import gated_residual, silu, silu_bwd, swiglu_bwd, swiglu_fwd
from h3lab.ops.fixed import chain_sum, round_to, unit_tree
from h3lab.ops.norm import qk_norm_rope_bwd, qk_norm_rope_fwd, rms_modulate_bwd, rms_modulate_fwd, rope_tables
from h3lab.ops.rows import key_order
from h3lab.result import BlockResult
from h3lab.units import UnitWeights, assemble_unit_grads, unit_weights
from h3lab.weights import BlockWeights


@dataclass(frozen=True, eq=False)
class BlockStep:
    """What one rank computes: its local rows of out/dx, its unit slices of dW, replicated grads."""

    out: Tensor  # [R_local, D], padding rows zero
    dx: Tensor  # [R_local, D], padding rows zero
    dw_units: dict[str, dict[int, Tensor]]  # unit-sharded parameters, per unit
    dw_replicated: dict[str, Tensor]  # norm1, norm2, norm_q, norm_k (every rank holds all)
    dtemb: Tensor  # [T, E] float32
    timings: dict[str, float]  # forward_s, backward_s (this rank, collectives included)


def canonical_block(weights: BlockWeights, batch: PackedBatch, *, backend: str | None = None) -> BlockResult:
    """Forward, dX, every dW and d temb of one H3 block under the h3-parallel-v1 contract.

    Args:
        weights: one block's tensors (`h3lab.load_block` or `h3lab.weights.synthetic_block`).
        batch: one packed request with its upstream gradient (`h3lab.packed_batch`).
        backend: "torch" (default, CPU and GPU), "triton" (GPU) or "baseline" (library kernels,
            not layout-invariant: the reference point of the baseline mode); see h3lab.backend.

    Returns:
        `BlockResult`: out and dx in the activation dtype, dw in each parameter's dtype, keyed by
        diffusers names, dtemb in float32. Padding rows of out and dx are zero.

    Raises:
        ValueError: shapes that do not match the config, an unsupported device or dtype, TF32 on.
    """
    step = block_step(unit_weights(weights), batch, LocalComm(), backend=backend)
    dw = assemble_unit_grads(step.dw_units, LocalComm.units) | step.dw_replicated
    names = list(weights.tensors)  # diffusers order
    return BlockResult(out=step.out, dx=step.dx, dw={k: dw[k] for k in names}, dtemb=step.dtemb)


def _check(uw: UnitWeights, b: PackedBatch) -> None:
    c = uw.config
    check_device(b.device)
    if b.hidden_states.shape[1] != c.hidden_size:
        raise ValueError(
            f"hidden_states has {b.hidden_states.shape[1]} channels; the block's hidden_size is {c.hidden_size}"
        )
    if b.temb.shape[1] != c.time_embed_dim:
        raise ValueError(f"temb has {b.temb.shape[1]} channels; the block's time_embed_dim is {c.time_embed_dim}")
    devices = {t.device for t in uw.replicated.values()}
    if devices != {b.device}:
        raise ValueError(f"weights on {sorted(map(str, devices))} but the batch on {b.device}; move one of them")


def block_step(uw: UnitWeights, b: PackedBatch, comm: BlockComm, *, backend: str | None = None) -> BlockStep:
    """The block on this rank's rows and units; `comm` supplies the layout's data movement."""
    _check(uw, b)
    be = get_backend(backend, b.device)
    with strict_mode(), torch.no_grad():
        return _block_step(uw, b, comm, be)


def _block_step(uw: UnitWeights, b: PackedBatch, comm: BlockComm, be: Backend) -> BlockStep:
    c, units = uw.config, comm.units
    clock = _Clock(b.device)
    act, w_dt = b.hidden_states.dtype, uw.q[units[0]].dtype

    def R(t: Tensor) -> Tensor:  # the one rounding at an op's output
        return round_to(t, act)

    eps, qk_eps = c.norm_eps, c.qk_norm_eps
    T, D, Dh, H8 = b.num_timesteps, c.hidden_size, c.attention_head_dim, c.heads_per_unit
    scale = 1.0 / Dh**0.5
    rep = {k: v for k, v in uw.replicated.items()}

    # ---- row metadata in the three row spaces ----------------------------------------------
    x, idx, keys = b.hidden_states, b.adaln_indices, b.logical_keys
    active = (keys[:, 0] >= 0).unsqueeze(1)
    keys_seq = comm.gather_seq_rows(comm.gather_tp_rows(keys, "meta.keys"), "meta.keys")
    idx_seq = comm.gather_seq_rows(comm.gather_tp_rows(idx, "meta.adaln"), "meta.adaln")
    pos_tp = comm.gather_tp_rows(b.position_ids, "meta.pos")
    order = key_order(keys_seq)  # canonical order of every cross-row reduction
    if order.numel() == 0:  # a rank's shard may be all padding, the sequence may not
        raise ValueError("logical_keys: every row of the sequence is padding; need at least one active row")
    seq = lambda t, site: comm.gather_seq_rows(t, site)  # noqa: E731
    seq_local = lambda t, site: seq(comm.gather_tp_rows(t, site), site)  # noqa: E731

    # ---- F1 AdaLN table: silu(temb) in FP32, one cast to the projection dtype (diffusers) ----
    st = round_to(silu(b.temb), w_dt)
    parts = [round_to(be.mm(st, uw.adaln_w[u].t()) + uw.adaln_b[u].to(torch.float32), w_dt) for u in units]
    table = comm.gather_units(torch.cat(parts, dim=1), "adaln.table", dim=1).view(3 * T, 6, D)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table[idx].unbind(1)  # each [R_local, D]

    # ---- F2-F5 norm1, q/k/v, q/k norm + RoPE, attention ------------------------------------
    m1 = R(rms_modulate_fwd(x, rep["norm1.weight"], scale_msa, shift_msa, eps))
    m1_tp = comm.gather_tp_rows(m1, "sp.gather.m1")
    cos, sin = rope_tables(pos_tp, c.rope_freq_dim, c.rope_theta)
    heads = lambda t: t.view(t.shape[0], H8, Dh)  # noqa: E731
    q_u = {u: R(be.mm(m1_tp, uw.q[u].t())) for u in units}
    k_u = {u: R(be.mm(m1_tp, uw.k[u].t())) for u in units}
    v_u = {u: R(be.mm(m1_tp, uw.v[u].t())) for u in units}
    wq, wk = rep["attn.norm_q.weight"], rep["attn.norm_k.weight"]
    qr = torch.cat([R(qk_norm_rope_fwd(heads(q_u[u]), wq, cos, sin, qk_eps)) for u in units], dim=1)
    kr = torch.cat([R(qk_norm_rope_fwd(heads(k_u[u]), wk, cos, sin, qk_eps)) for u in units], dim=1)
    v = torch.cat([heads(v_u[u]) for u in units], dim=1)  # [R_tp, H_local, Dh]
    k_c = seq(kr, "cp.gather.k")[order]  # keys in canonical order, padding dropped
    v_c = seq(v, "cp.gather.v")[order]
    o32, rowmax, denom = be.attention_fwd(qr, k_c, v_c, scale)
    attn = R(o32)
    attn_u = {u: attn[:, i * H8 : (i + 1) * H8].reshape(attn.shape[0], -1) for i, u in enumerate(units)}

    # ---- F6-F11 to_out, residual, norm2, SwiGLU, ff.net.2, residual --------------------------
    root = be.unit_reduce([[(attn_u[u], uw.out[u].t())] for u in units])
    o_proj = R(comm.reduce_units(root, "attn.to_out.0", scatter_rows=True))
    x1 = R(gated_residual(x, gate_msa, o_proj))
    m2 = R(rms_modulate_fwd(x1, rep["norm2.weight"], scale_mlp, shift_mlp, eps))
    m2_tp = comm.gather_tp_rows(m2, "sp.gather.m2")
    h_u = {u: R(be.mm(m2_tp, uw.hidden[u].t())) for u in units}
    g_u = {u: R(be.mm(m2_tp, uw.gate[u].t())) for u in units}
    a_u = {u: R(swiglu_fwd(h_u[u], g_u[u])) for u in units}
    root = be.unit_reduce([[(a_u[u], uw.down[u].t())] for u in units])
    y = R(comm.reduce_units(root, "ff.net.2", scatter_rows=True))
    out = R(gated_residual(x1, gate_mlp, y))
    forward_s = clock.lap()

    # ---- B11-B9 backward through ff: padding rows carry no gradient --------------------------
    g = torch.where(active, b.grad_out.to(torch.float32), 0.0)
    d_gate_mlp = g * y.to(torch.float32)
    dy = R(g * gate_mlp.to(torch.float32))
    dy_tp = comm.gather_tp_rows(dy, "sp.gather.dy")
    dy_seq, m2_seq = seq(dy_tp, "cp.gather.dy"), seq(m2_tp, "cp.gather.m2")
    dw: dict[str, dict[int, Tensor]] = {
        k: {}
        for k in (
            "attn.to_q.weight",
            "attn.to_k.weight",
            "attn.to_v.weight",
            "attn.to_out.0.weight",
            "ff.hidden",
            "ff.gate",
            "ff.net.2.weight",
            "adaln_proj.linear.weight",
            "adaln_proj.linear.bias",
        )
    }
    dx_parts = []
    for u in units:
        da = R(be.mm(dy_tp, uw.down[u]))
        dw["ff.net.2.weight"][u] = round_to(be.row_mm(dy_seq, seq(a_u[u], "cp.gather.a"), order), w_dt)
        dh32, dg32 = swiglu_bwd(da, h_u[u], g_u[u])
        dh, dg = R(dh32), R(dg32)
        dx_parts.append([(dh, uw.hidden[u]), (dg, uw.gate[u])])  # hidden, then gate
        dw["ff.hidden"][u] = round_to(be.row_mm(seq(dh, "cp.gather.dh"), m2_seq, order), w_dt)
        dw["ff.gate"][u] = round_to(be.row_mm(seq(dg, "cp.gather.dg"), m2_seq, order), w_dt)
    dm2 = R(comm.reduce_units(be.unit_reduce(dx_parts), "ff.net.0.dx", scatter_rows=True))

    # ---- B8-B6 norm2, residual 1, to_out --------------------------------------------------
    dxn2, dw_norm2, d_scale_mlp, d_shift_mlp = rms_modulate_bwd(dm2, x1, rep["norm2.weight"], scale_mlp, eps)
    dx1 = g + dxn2
    d_gate_msa = dx1 * o_proj.to(torch.float32)
    do = R(dx1 * gate_msa.to(torch.float32))
    do_tp = comm.gather_tp_rows(do, "sp.gather.do")
    do_seq = seq(do_tp, "cp.gather.do")
    dattn_u = {}
    for u in units:
        dattn_u[u] = R(be.mm(do_tp, uw.out[u]))
        dw["attn.to_out.0.weight"][u] = round_to(be.row_mm(do_seq, seq(attn_u[u], "cp.gather.attn"), order), w_dt)

    # ---- B5 attention: dq for this rank's queries, dk/dv for its keys over every query -------
    dO = torch.cat([heads(dattn_u[u]) for u in units], dim=1)
    delta = att.attention_delta(dO, o32)
    dq = be.attention_bwd_q(qr, dO, rowmax, denom, delta, k_c, v_c, scale)
    gather_q = lambda t, site: seq(t.transpose(0, 1), site)[order].transpose(0, 1)  # [H, R] stats  # noqa: E731
    q_c, dO_c = seq(qr, "cp.gather.q")[order], seq(dO, "cp.gather.dO")[order]
    stats_c = [gather_q(t, f"cp.gather.{n}") for t, n in ((rowmax, "rowmax"), (denom, "denom"), (delta, "delta"))]
    dk, dv = be.attention_bwd_kv(q_c, dO_c, *stats_c, kr, v, scale)

    # ---- B4-B3 RoPE + q/k norm, then q,k,v dX and dW -----------------------------------------
    m1_seq = seq(m1_tp, "cp.gather.m1")
    dx_parts, dwq_rows, dwk_rows = [], [], []
    for i, u in enumerate(units):
        hs = slice(i * H8, (i + 1) * H8)
        dq32, dwq_u = qk_norm_rope_bwd(dq[:, hs], heads(q_u[u]), wq, cos, sin, qk_eps)
        dk32, dwk_u = qk_norm_rope_bwd(dk[:, hs], heads(k_u[u]), wk, cos, sin, qk_eps)
        dwq_rows.append(dwq_u), dwk_rows.append(dwk_u)
        flat = lambda t: t.reshape(t.shape[0], -1)  # noqa: E731
        dq_u, dk_u, dv_u = R(flat(dq32)), R(flat(dk32)), R(flat(dv[:, hs]))
        dx_parts.append([(dq_u, uw.q[u]), (dk_u, uw.k[u]), (dv_u, uw.v[u])])  # q, k, v
        for name, d in (("attn.to_q.weight", dq_u), ("attn.to_k.weight", dk_u), ("attn.to_v.weight", dv_u)):
            dw[name][u] = round_to(be.row_mm(seq(d, f"cp.gather.d{name[8]}"), m1_seq, order), w_dt)
    dm1 = R(comm.reduce_units(be.unit_reduce(dx_parts), "attn.qkv.dx", scatter_rows=True))

    # ---- B2 norm1, dx ------------------------------------------------------------------------
    dxn1, dw_norm1, d_scale_msa, d_shift_msa = rms_modulate_bwd(dm1, x, rep["norm1.weight"], scale_msa, eps)
    zero_pad = lambda t: torch.where(active, t, torch.zeros((), dtype=t.dtype))  # noqa: E731
    dx = zero_pad(R(dx1 + dxn1))

    # ---- cross-row weight gradients: rows of the whole sequence in key order ------------------
    p_dt = lambda name: rep[name].dtype  # noqa: E731
    dw_rep = {
        "norm1.weight": round_to(be.row_sum(seq_local(dw_norm1, "cp.gather.dnorm1"), order), p_dt("norm1.weight")),
        "norm2.weight": round_to(be.row_sum(seq_local(dw_norm2, "cp.gather.dnorm2"), order), p_dt("norm2.weight")),
    }
    for name, rows in (("attn.norm_q.weight", dwq_rows), ("attn.norm_k.weight", dwk_rows)):
        per_head = be.row_sum(seq(torch.cat(rows, dim=1), f"cp.gather.{name}"), order)  # [H_local, Dh]
        per_unit = [chain_sum(per_head[i * H8 : (i + 1) * H8]) for i in range(len(units))]  # heads ascending
        dw_rep[name] = round_to(comm.reduce_units(unit_tree(per_unit), name), p_dt(name))

    # ---- B1 AdaLN table rows (segmented, key order), then its projection ---------------------
    d_rows = torch.stack([d_shift_msa, d_scale_msa, d_gate_msa, d_shift_mlp, d_scale_mlp, d_gate_mlp], dim=1)
    d_table = be.segment_sum(seq_local(d_rows, "cp.gather.dtable"), idx_seq, 3 * T, order).reshape(T, -1)
    G8 = c.adaln_dim // 8
    dst_parts = []
    for u in units:
        cols = d_table[:, u * G8 : (u + 1) * G8]  # [T, 18D/8]
        dw["adaln_proj.linear.weight"][u] = round_to(be.mm(cols.t(), st), w_dt)  # timesteps ascending
        dw["adaln_proj.linear.bias"][u] = round_to(chain_sum(cols), w_dt)
        dst_parts.append([(cols, uw.adaln_w[u])])
    dtemb = silu_bwd(comm.reduce_units(be.unit_reduce(dst_parts), "adaln.dtemb"), b.temb)

    timings = {"forward_s": forward_s, "backward_s": clock.lap()}
    return BlockStep(out=zero_pad(out), dx=dx, dw_units=dw, dw_replicated=dw_rep, dtemb=dtemb, timings=timings)


class _Clock:
    """Wall-clock laps; synchronises CUDA first so a lap covers the kernels it launched."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        lap, self.t = now - self.t, now
        return lap
