"""The block step's backward in parts named after its sections (B11-B1): dX, every weight gradient
of this rank's units, the replicated weights' gradients and d temb.

Each part takes its records of the forward, and what the part before handed it, off the step's tape
where it starts, and puts what it hands the next part on it: so each tensor goes as soon as the
last part that reads it returns (h3lab.block.forward: lifetimes). What lives to the step's end (dx1,
the gradients of the replicated weights and of the AdaLN table, the weight gradients in `dw`) is
returned. The arithmetic follows h3lab.contract; the order of the parts and of the kernels inside
each is the order in which the backward runs.

Dimension legend: as h3lab.block.forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from h3lab.batch import PackedBatch
from h3lab.block.forward import (
    AttentionSaved,
    FfnSaved,
    Norm1Saved,
    QkSaved,
    QkvSaved,
    Rows,
    Step,
    Tape,
    ToOutSaved,
    zero_padding,
)
from h3lab.block.rowspace import ChainSet, RowSpace, sum_chain_sets
from h3lab.config import NUM_UNITS
from h3lab.ops.fixed import chain_sum, unit_tree
from h3lab.units import join

F32 = torch.float32


class FfnGrads(NamedTuple):  # B11-B9 -> B8-B6
    g_out: Tensor  # [R_local, D] FP32 upstream gradient, padding rows zero
    d_gate_mlp: Tensor  # [R_local, D] FP32
    dm2: Tensor  # [R_local, D] norm2's output gradient


class ToOutGrads(NamedTuple):  # B8-B6 -> B5
    dattn: Tensor  # [R_tp, A_local] the attention's output gradient


class AttentionGrads(NamedTuple):  # B5 -> B4
    dq: Tensor  # [R_tp, H_local, Dh] FP32, before q norm + RoPE's backward
    dk: Tensor  # [R_tp, H_local, Dh] FP32, before k norm + RoPE's backward
    dv: Tensor  # [R_tp, H_local, Dh] FP32


class Gradients(NamedTuple):
    dx: Tensor  # [R_local, D], padding rows zero
    dw_units: dict[str, dict[int, Tensor]]  # unit-sharded parameters, per unit, in the weights' dtype
    dw_replicated: dict[str, Tensor]  # norm1, norm2, norm_q, norm_k
    dtemb: Tensor  # [T, E] float32


def backward(step: Step, b: PackedBatch, rows: Rows, st: Tensor, tape: Tape) -> Gradients:
    """B11-B1 on this rank's rows and units, from the forward's records on `tape` (all taken)."""
    dw: dict[str, Tensor] = {}  # this rank's weight gradients (unit-major), in the order they are made
    _ffn_backward(step, rows, b.grad_out, tape, dw)
    dx1, d_gate_msa, dnorm2, d_table_mlp = _norm2_to_out_backward(step, rows, tape, dw)
    _attention_backward(step, rows, tape)
    dm1, dwq_rows, dwk_rows = _qkv_backward(step, rows, tape, dw)
    dx, dw_norm1, d_scale_msa, d_shift_msa = _norm1_backward(step, rows, tape, b.hidden_states, dm1, dx1)
    d_msa = (d_shift_msa, d_scale_msa, d_gate_msa)
    dw_rep, d_table_msa = _cross_row_gradients(step, rows, dw_norm1, (dwq_rows, dwk_rows), d_msa, dnorm2)
    dtemb = _adaln_backward(step, st, d_table_msa + d_table_mlp, b.temb, dw)
    assert not tape, "every record of the step taken once"
    return Gradients(dx, _per_unit(step, dw), dw_rep, dtemb)


def _ffn_backward(step: Step, rows: Rows, grad_out: Tensor, tape: Tape, dw: dict[str, Tensor]) -> None:
    """B11-B9 backward through ff (padding rows carry no gradient): ff.net.2's and ff.net.0's weight
    gradients into `dw`; hands on the upstream gradient, d gate_mlp and d norm2's output. The block's
    peak memory falls in this part (SwiGLU's backward, the weight-gradient GEMMs): each tensor is
    deleted at its last read."""
    be, tr, rs, act, w_dt, loc = step.be, step.tr, step.rs, step.act, step.w_dt, step.uw.local
    y, m2_tp, h, g, a, gate_mlp = tape.take(FfnSaved)
    g_out = torch.where(rows.active, grad_out.to(F32), 0.0)
    d_gate_mlp = g_out * y.to(F32)
    dy = tr("d.ff.net.2", be.round(g_out * gate_mlp.to(F32), act), "local")
    del y, gate_mlp
    dy_tp = rs.tp(dy, "sp.gather.dy")
    dy_seq, m2_seq = rs.seq(dy_tp, "cp.gather.dy"), rs.seq(m2_tp, "cp.gather.m2")
    da = tr("d.ff.swiglu", be.mm(dy_tp, loc["down"], act), "tp_units")  # [R_tp, F_local]
    dh, dg = be.swiglu_bwd(da, h, g, act)
    F_local = h.shape[1]
    del da, h, g
    dh, dg = tr("d.ff.hidden", dh, "tp_units"), tr("d.ff.gate", dg, "tp_units")
    root = be.unit_reduce([(dh, loc["hidden"]), (dg, loc["gate"])], step.num_units)  # hidden, then gate
    # the reduction's bytes move while the weight-gradient GEMMs below run (they do not need it); each
    # owner rounds its sums before they are shared; the comm holds what it still sends
    finish_dm2 = rs.comm.start_reduce_units(root, "ff.net.0.dx", scatter_rows=True, then=partial(be.round, dtype=act))
    del root
    # hidden's and gate's weight gradients as one GEMM over [dh | dg] (a view of the Triton kernel's
    # one buffer; a copy on torch) into one [2 F_local, D] tensor, ff.net.0's own layout: as two GEMMs,
    # handing out ff.net.0 would copy them into it. Per element the same chain.
    dw_ff0 = be.row_mm(rs.seq(join([dh, dg], dim=1), "cp.gather.dhg"), m2_seq, rows.order, w_dt)  # [2 F_local, D]
    del dh, dg, m2_tp, m2_seq
    dw["ff.net.2.weight"] = be.row_mm(dy_seq, rs.seq(a, "cp.gather.a"), rows.order, w_dt)  # [D, F_local]
    del dy, dy_tp, dy_seq, a
    dw["ff.hidden"], dw["ff.gate"] = dw_ff0[:F_local], dw_ff0[F_local:]  # [F_local, D] each
    dm2 = tr("d.norm2", finish_dm2(), "local")
    tape.put(FfnGrads(g_out, d_gate_mlp, dm2))


def _norm2_to_out_backward(
    step: Step, rows: Rows, tape: Tape, dw: dict[str, Tensor]
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """B8-B6 norm2, residual 1, to_out (its weight gradient into `dw`; hands on d attention output),
    then norm2's cross-row gradients, so that its four FP32 [R, D] row tensors go before the
    attention's: (d x1, d gate_msa, d norm2.weight, the AdaLN table's mlp columns of d table). Each
    tensor is deleted at its last read."""
    be, tr, rs, act = step.be, step.tr, step.rs, step.act
    w2 = step.uw.replicated["norm2.weight"]
    x1, o_proj, attn, gate_msa, scale_mlp = tape.take(ToOutSaved)
    g_out, d_gate_mlp, dm2 = tape.take(FfnGrads)
    dxn2, dw_norm2, d_scale_mlp, d_shift_mlp = be.rms_modulate_bwd(dm2, x1, w2, scale_mlp, step.config.norm_eps)
    del dm2, x1, scale_mlp
    dx1 = g_out + dxn2
    del g_out, dxn2
    d_gate_msa = dx1 * o_proj.to(F32)
    del o_proj
    do = tr("d.attn.to_out.0", be.round(dx1 * gate_msa.to(F32), act), "local")
    del gate_msa
    do_tp = rs.tp(do, "sp.gather.do")
    dattn = tr("d.attn.sdpa", be.mm(do_tp, step.uw.local["out"], act), "tp_units")  # [R_tp, A_local]
    dw["attn.to_out.0.weight"] = be.row_mm(
        rs.seq(do_tp, "cp.gather.do"), rs.seq(attn, "cp.gather.attn"), rows.order, step.w_dt
    )  # [D, A_local]
    del do, do_tp, attn
    tape.put(ToOutGrads(dattn))
    # the four chain sets in one call (on the GPU one launch: a set alone is latency-bound)
    mlp_sets = _table_sets(rs, (d_shift_mlp, d_scale_mlp, d_gate_mlp), first=3)
    row_sets: list[ChainSet] = [(dw_norm2, rs.seq_local, "cp.gather.dnorm2")]
    (dnorm2,), d_table_mlp = sum_chain_sets(be, row_sets, mlp_sets, rows.segments, 3 * step.num_timesteps, rows.order)
    return dx1, d_gate_msa, be.round(dnorm2, w2.dtype), d_table_mlp


def _attention_backward(step: Step, rows: Rows, tape: Tape) -> None:
    """B5 attention: hands on dq for this rank's queries and dk/dv for its keys over every query.
    Where this rank's TP rows are the whole sequence (no CP), one fused call over every query and
    key in canonical order (be.attention_bwd: the same bytes as the two calls), its rows put back;
    padding rows get zero gradients (nothing reads them: their rows are dropped before every
    cross-row sum and zeroed in dx)."""
    be, rs, order = step.be, step.rs, rows.order
    scale = 1.0 / step.config.attention_head_dim**0.5
    qr, kr, v, k_c, v_c, o_ref, stats = tape.take(AttentionSaved)
    (dattn,) = tape.take(ToOutGrads)
    dO = step.heads(dattn)
    delta = be.attention_delta(dO, o_ref)  # [H_local, R_tp]
    q_c, dO_c = rs.seq_in_order(qr, "cp.gather.q", order), rs.seq_in_order(dO, "cp.gather.dO", order)
    stats_c = [rs.seq_columns_in_order(t, f"cp.gather.stats{i}", order) for i, t in enumerate(stats)]
    delta_c = rs.seq_columns_in_order(delta, "cp.gather.delta", order)
    R_tp = qr.shape[0]
    if R_tp == rows.segments.shape[0]:
        grads = list(be.attention_bwd(q_c, dO_c, stats_c, delta_c, k_c, v_c, scale))
        for i in range(3):  # one FP32 copy at a time
            grads[i] = rs.tp_from_order(grads[i], order, R_tp)
        dq, dk, dv = grads
        del grads
    else:
        dq = be.attention_bwd_q(qr, dO, stats, delta, k_c, v_c, scale)
        dk, dv = be.attention_bwd_kv(q_c, dO_c, stats_c, delta_c, kr, v, scale)
    tape.put(AttentionGrads(dq, dk, dv))


def _qkv_backward(step: Step, rows: Rows, tape: Tape, dw: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """B4-B3 RoPE + q/k norm, then q, k, v dX (unit tree) and dW (into `dw`): (d norm1's output,
    the rows of q norm's and k norm's weight gradients)."""
    be, tr, rs, act, loc = step.be, step.tr, step.rs, step.act, step.uw.local
    (m1_tp,) = tape.take(QkvSaved)
    dq, dk, dv, dwq_rows, dwk_rows = _qk_norm_rope_backward(step, tape)
    R_tp = dq.shape[0]
    dq, dk, dv = dq.reshape(R_tp, -1), dk.reshape(R_tp, -1), be.round(dv, act).reshape(R_tp, -1)
    dq, dk, dv = (tr(f"d.attn.to_{n}", t, "tp_units") for n, t in (("q", dq), ("k", dk), ("v", dv)))
    root = be.unit_reduce([(dq, loc["q"]), (dk, loc["k"]), (dv, loc["v"])], step.num_units)  # q, k, v
    # moves during the weight-gradient GEMMs below, rounded by each owner before it is shared
    finish_dm1 = rs.comm.start_reduce_units(root, "attn.qkv.dx", scatter_rows=True, then=partial(be.round, dtype=act))
    m1_seq = rs.seq(m1_tp, "cp.gather.m1")
    for name, d in (("attn.to_q.weight", dq), ("attn.to_k.weight", dk), ("attn.to_v.weight", dv)):
        dw[name] = be.row_mm(rs.seq(d, f"cp.gather.d{name[8]}"), m1_seq, rows.order, step.w_dt)  # [A_local, D]
    dm1 = tr("d.norm1", finish_dm1(), "local")
    return dm1, dwq_rows, dwk_rows


def _qk_norm_rope_backward(step: Step, tape: Tape) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """B4 RoPE + q/k norm: (dq, dk [R_tp, H_local, Dh] in the activation dtype, dv as the attention
    gave it, the per-row gradients of q norm's and k norm's weights); q and k go when it returns."""
    be, act, eps, rep = step.be, step.act, step.config.qk_norm_eps, step.uw.replicated
    q, k, cos, sin = tape.take(QkSaved)
    dq, dk, dv = tape.take(AttentionGrads)
    dq, dwq_rows = be.qk_norm_rope_bwd(dq, step.heads(q), rep["attn.norm_q.weight"], cos, sin, eps, act)
    dk, dwk_rows = be.qk_norm_rope_bwd(dk, step.heads(k), rep["attn.norm_k.weight"], cos, sin, eps, act)
    return dq, dk, dv, dwq_rows, dwk_rows


def _norm1_backward(
    step: Step, rows: Rows, tape: Tape, x: Tensor, dm1: Tensor, dx1: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """B2 norm1, dx: (dx [R_local, D], padding rows zero; norm1's weight gradient rows, d scale_msa,
    d shift_msa)."""
    be, eps = step.be, step.config.norm_eps
    (scale_msa,) = tape.take(Norm1Saved)
    dxn1, dw_norm1, d_scale_msa, d_shift_msa = be.rms_modulate_bwd(
        dm1, x, step.uw.replicated["norm1.weight"], scale_msa, eps
    )
    dx = step.tr("dx", zero_padding(rows.active, be.round(dx1 + dxn1, step.act)), "local")
    return dx, dw_norm1, d_scale_msa, d_shift_msa


def _cross_row_gradients(
    step: Step,
    rows: Rows,
    dw_norm1: Tensor,
    qk_rows: tuple[Tensor, Tensor],
    msa: tuple[Tensor, Tensor, Tensor],
    dnorm2: Tensor,
) -> tuple[dict[str, Tensor], list[Tensor]]:
    """The cross-row gradients of the replicated weights (rows of the whole sequence in key order) and
    B1's AdaLN table rows of the msa columns (segmented, key order): six chain sets in one call.
    Returns (the replicated weights' gradients, the msa columns of d table)."""
    be, rs, rep = step.be, step.rs, step.uw.replicated
    qk_names = ("attn.norm_q.weight", "attn.norm_k.weight")
    row_sets: list[ChainSet] = [(dw_norm1, rs.seq_local, "cp.gather.dnorm1")]
    row_sets += [(t, rs.seq, f"cp.gather.{name}") for name, t in zip(qk_names, qk_rows, strict=True)]
    table_sets = _table_sets(rs, msa, first=0)
    (dnorm1, *per_heads), d_table_msa = sum_chain_sets(
        be, row_sets, table_sets, rows.segments, 3 * step.num_timesteps, rows.order
    )
    dw_rep = {"norm1.weight": be.round(dnorm1, rep["norm1.weight"].dtype), "norm2.weight": dnorm2}
    U, H8 = step.num_units, step.config.heads_per_unit
    for name, per_head in zip(qk_names, per_heads, strict=True):  # [H_local, Dh]
        per_unit = chain_sum(per_head.view(U, H8, -1).transpose(0, 1))  # [U, Dh]: each unit's heads ascending
        dw_rep[name] = be.round(rs.comm.reduce_units(unit_tree(list(per_unit.unbind(0))), name), rep[name].dtype)
    return dw_rep, d_table_msa


def _table_sets(rs: RowSpace, columns: Sequence[Tensor], first: int) -> list[ChainSet]:
    """Chain sets of the AdaLN table's row gradients of columns first, first + 1, ... (each [R_local,
    D]): one chain per column, so the sets give the bits of one stacked [R, 6, D] set without its
    6·R·D FP32 copy at the block's peak memory."""
    return [(d, rs.seq_local, f"cp.gather.dtable{i}") for i, d in enumerate(columns, start=first)]


def _adaln_backward(step: Step, st: Tensor, d_table_cols: list[Tensor], temb: Tensor, dw: dict[str, Tensor]) -> Tensor:
    """B1 the AdaLN projection: its weight and bias gradients into `dw`; d temb [T, E] FP32."""
    be, units = step.be, step.rs.units
    G8 = step.config.adaln_dim // NUM_UNITS
    d_table = torch.stack(d_table_cols, dim=1).reshape(step.num_timesteps, -1)  # [T, 3 modalities x 6 x D]
    d_cols = d_table[:, units.start * G8 : units.stop * G8]  # [T, 18D/8 * local units]
    dw["adaln_proj.linear.weight"] = be.mm_few_k(d_cols, st, step.w_dt)  # timesteps ascending
    dw["adaln_proj.linear.bias"] = chain_sum(d_cols)
    dst = be.unit_reduce_few_rows(d_cols, step.uw.local["adaln_w"], step.num_units)
    return be.silu_bwd(step.rs.comm.reduce_units(dst, "adaln.dtemb"), temb)


def _per_unit(step: Step, dw: dict[str, Tensor]) -> dict[str, dict[int, Tensor]]:
    """Per-unit views of this rank's weight gradients, rounded once to the weights' dtype."""
    c = step.config
    A8, F8, G8 = c.inner_dim // NUM_UNITS, c.ffn_dim // NUM_UNITS, c.adaln_dim // NUM_UNITS
    unit_rows = {
        "attn.to_q.weight": A8,
        "attn.to_k.weight": A8,
        "attn.to_v.weight": A8,
        "ff.hidden": F8,
        "ff.gate": F8,
        "adaln_proj.linear.weight": G8,
        "adaln_proj.linear.bias": G8,
    }
    unit_cols = {"attn.to_out.0.weight": A8, "ff.net.2.weight": F8}
    per_unit = {}
    for name, t in dw.items():
        t = step.be.round(t, step.w_dt)  # a no-op for the GEMM results, which rounded in their epilogue
        if name in unit_rows:
            per_unit[name] = step.rs.unit_rows(t, unit_rows[name])
        else:
            per_unit[name] = step.rs.unit_cols(t, unit_cols[name])
    return per_unit
