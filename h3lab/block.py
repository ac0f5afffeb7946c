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

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from h3lab.backend import Backend, get_backend
from h3lab.batch import PackedBatch
from h3lab.comm import BlockComm, LocalComm
from h3lab.contract import check_device, strict_mode
from h3lab.ops.fixed import chain_sum, unit_tree
from h3lab.result import BlockResult
from h3lab.rowplan import RowPlan, index_cache
from h3lab.units import UnitWeights, assemble_unit_grads, join, unit_weights
from h3lab.weights import BlockWeights


@dataclass(frozen=True, eq=False)
class BlockStep:
    """What one rank computes: its local rows of out/dx, its unit slices of dW, replicated grads."""

    out: Tensor  # [R_local, D], padding rows zero
    dx: Tensor | None  # [R_local, D], padding rows zero (None: forward only)
    dw_units: dict[str, dict[int, Tensor]] | None  # unit-sharded parameters, per unit
    dw_replicated: dict[str, Tensor] | None  # norm1, norm2, norm_q, norm_k (every rank holds all)
    dtemb: Tensor | None  # [T, E] float32
    # forward_s, backward_s (this rank, collectives included): on CUDA the GPU's own clock (events),
    # so a stretch where the GPU waits for the host, e.g. in a gloo collective, counts; on CPU wall time
    timings: dict[str, float]


class Trace(Protocol):
    """Sees every op's output in execution order, for the first-divergence finder; returns the
    tensor the block goes on with (the same one, or a planted fault in tests).

    `space` says how layouts shard it: "local" (this rank's rows), "tp_units" (TP rows x this
    rank's unit-major columns or heads), "replicated" (the same on every rank).
    """

    def __call__(self, name: str, t: Tensor, space: str) -> Tensor: ...


def _no_trace(name: str, t: Tensor, space: str) -> Tensor:
    return t


def canonical_block(
    weights: BlockWeights, batch: PackedBatch, *, backend: str | None = None, decided_rows: RowPlan | None = None
) -> BlockResult:
    """Forward, dX, every dW and d temb of one H3 block under the h3-parallel-v1 contract.

    Args:
        weights: one block's tensors (`h3lab.load_block` or `h3lab.weights.synthetic_block`).
        batch: one packed request with its upstream gradient (`h3lab.packed_batch`).
        backend: "torch" (default, CPU and GPU), "triton" (GPU) or "baseline" (library kernels,
            not layout-invariant: the reference point of the baseline mode); see h3lab.backend.
        decided_rows: the row plan of this batch's metadata decided beforehand
            (`h3lab.rowplan.decide_rows`, backend "triton"): the step then never waits for the
            host, as a CUDA graph capture needs (h3lab.graph).

    Returns:
        `BlockResult`: out and dx in the activation dtype, dw in each parameter's dtype, keyed by
        diffusers names, dtemb in float32. Padding rows of out and dx are zero.

    Raises:
        ValueError: shapes that do not match the config, an unsupported device or dtype, TF32 on.
    """
    step = block_step(unit_weights(weights), batch, LocalComm(), backend=backend, decided_rows=decided_rows)
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


def block_step(
    uw: UnitWeights,
    b: PackedBatch,
    comm: BlockComm,
    *,
    backend: str | None = None,
    backward: bool = True,
    trace: Trace | None = None,
    decided_rows: RowPlan | None = None,
) -> BlockStep:
    """The block on this rank's rows and units; `comm` supplies the layout's data movement.

    `backward=False` stops after the forward (a chain recomputes each block's forward in its
    backward pass); `trace` receives every op's output (h3lab.run.trace); `decided_rows`: see
    `canonical_block` (with `LocalComm` only: a layout's gathered metadata are tensors of its own).
    """
    _check(uw, b)
    be = get_backend(backend, b.device)
    # Triton launches on the current CUDA device: make it the batch's (rank 1 of a NCCL layout
    # holds cuda:1 while the current device may still be cuda:0)
    on_device = torch.cuda.device(b.device) if b.device.type == "cuda" else contextlib.nullcontext()
    with strict_mode(), torch.no_grad(), on_device, index_cache():
        return _block_step(uw, b, comm, be, backward, trace or _no_trace, decided_rows)


ChainSet = tuple[Tensor, Callable[[Tensor, str], Tensor], str]  # (rows, the gather to sequence rows, its site)


def _chain_sums(
    be: Backend,
    row_sets: list[ChainSet],
    table_sets: list[ChainSet],
    segment_R: Tensor,
    num_segments: int,
    order: Tensor,
) -> tuple[list[Tensor], list[Tensor]]:
    """be.chain_sums of the gathered row sets (row_sum) and table sets (segment_sum), the same bits as
    one call per set. A gather that copies (SP or CP layouts) has its set summed alone at once, so one
    gathered FP32 [R_seq, D] copy is alive at a time, as before the sets went side by side: the
    block's peak memory is in this part of the backward. Sets used in place go side by side in one
    call. Every rank takes the same path (the layout decides), so the gathers meet in one order."""
    outs: list[list[Tensor | None]] = [[None] * len(row_sets), [None] * len(table_sets)]
    in_place: list[list[tuple[int, Tensor]]] = [[], []]
    for kind, sets in enumerate((row_sets, table_sets)):
        for i, (t, gather, site) in enumerate(sets):
            g = gather(t, site)
            if g is t:
                in_place[kind].append((i, g))
                continue
            sums, segs = be.chain_sums(*(([g], []) if kind == 0 else ([], [g])), segment_R, num_segments, order)
            outs[kind][i] = (sums + segs)[0]
            del g
    if in_place[0] or in_place[1]:
        got = be.chain_sums([g for _, g in in_place[0]], [g for _, g in in_place[1]], segment_R, num_segments, order)
        for kind in (0, 1):
            for (i, _), out in zip(in_place[kind], got[kind], strict=True):
                outs[kind][i] = out
    assert all(o is not None for kinds in outs for o in kinds), "every chain set summed once"
    return outs[0], outs[1]  # type: ignore[return-value]


def _block_step(
    uw: UnitWeights,
    b: PackedBatch,
    comm: BlockComm,
    be: Backend,
    backward: bool,
    tr: Trace,
    decided_rows: RowPlan | None,
) -> BlockStep:
    c, units = uw.config, comm.units
    clock = _Clock(b.device)
    act, w_dt = b.hidden_states.dtype, uw.q[units[0]].dtype
    eps, qk_eps = c.norm_eps, c.qk_norm_eps
    T, D, Dh, H8 = b.num_timesteps, c.hidden_size, c.attention_head_dim, c.heads_per_unit
    A8, F8, G8 = c.inner_dim // 8, c.ffn_dim // 8, c.adaln_dim // 8
    scale = 1.0 / Dh**0.5
    rep, loc = uw.replicated, uw.local
    cols = lambda t, u, n: t[:, (u - units.start) * n : (u - units.start + 1) * n]  # noqa: E731  unit u's columns

    # ---- row metadata in the three row spaces ----------------------------------------------
    x, idx, keys = b.hidden_states, b.adaln_indices, b.logical_keys
    active = (keys[:, 0] >= 0).unsqueeze(1)
    keys_seq = comm.gather_seq_rows(comm.gather_tp_rows(keys, "meta.keys"), "meta.keys")
    idx_seq = comm.gather_seq_rows(comm.gather_tp_rows(idx, "meta.adaln"), "meta.adaln")
    pos_tp = comm.gather_tp_rows(b.position_ids, "meta.pos")
    # the canonical order of every cross-row reduction, with every index check of the block (RoPE's
    # too), is read after the q/k/v GEMMs are queued: on the GPU a check is a host sync, which drains
    # the queue (2.2 ms of idle GPU at the block start, 1.3 ms after norm1 and 0.7 ms after the
    # attention backward at 4096 rows, when each check synced where it was needed: reports/h200/)
    order_when_ready = be.plan_rows(keys_seq, idx_seq, 3 * T, pos_tp, decided=decided_rows)
    seq = lambda t, site: comm.gather_seq_rows(t, site)  # noqa: E731
    seq_local = lambda t, site: seq(comm.gather_tp_rows(t, site), site)  # noqa: E731

    # ---- F1 AdaLN table: silu(temb) in FP32, one cast to the projection dtype (diffusers) ----
    st = be.silu(b.temb, w_dt)
    table_local = be.round(be.mm(st, loc["adaln_w"].t()) + loc["adaln_b"].to(torch.float32), w_dt)
    table = tr("adaln.table", comm.gather_units(table_local, "adaln.table", dim=1).view(3 * T, 6, D), "replicated")
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table[idx].unbind(1)  # each [R_local, D]

    # ---- F2-F5 norm1, q/k/v (this rank's units in one GEMM each), q/k norm + RoPE, attention --
    m1 = tr("norm1", be.rms_modulate_fwd(x, rep["norm1.weight"], scale_msa, shift_msa, eps, act), "local")
    m1_tp = comm.gather_tp_rows(m1, "sp.gather.m1")
    R_tp = m1_tp.shape[0]
    heads = lambda t: t.view(R_tp, -1, Dh)  # noqa: E731
    q = tr("attn.to_q", be.mm(m1_tp, loc["q"].t(), act), "tp_units")  # [R_tp, A_local]
    k = tr("attn.to_k", be.mm(m1_tp, loc["k"].t(), act), "tp_units")
    v = tr("attn.to_v", heads(be.mm(m1_tp, loc["v"].t(), act)), "tp_units")
    order = order_when_ready()
    if order.numel() == 0:  # a rank's shard may be all padding, the sequence may not
        raise ValueError("logical_keys: every row of the sequence is padding; need at least one active row")
    cos, sin = be.rope_tables(pos_tp, c.rope_freq_dim, c.rope_theta)  # [R_tp, 6f] FP32
    wq, wk = rep["attn.norm_q.weight"], rep["attn.norm_k.weight"]
    qr = tr("attn.norm_q+rope", be.qk_norm_rope_fwd(heads(q), wq, cos, sin, qk_eps, act), "tp_units")
    kr = tr("attn.norm_k+rope", be.qk_norm_rope_fwd(heads(k), wk, cos, sin, qk_eps, act), "tp_units")
    k_c = seq(kr, "cp.gather.k")[order]  # keys in canonical order, padding dropped
    v_c = seq(v, "cp.gather.v")[order]
    attn3, o_ref, stats = be.attention_fwd(qr, k_c, v_c, scale, act)
    attn = tr("attn.sdpa", attn3.reshape(R_tp, -1), "tp_units")  # [R_tp, A_local]

    # ---- F6-F11 to_out, residual, norm2, SwiGLU, ff.net.2, residual --------------------------
    U = len(units)
    root = be.unit_reduce([(attn, loc["out"].t())], U)
    o_proj = tr("attn.to_out.0", be.round(comm.reduce_units(root, "attn.to_out.0", scatter_rows=True), act), "local")
    x1 = tr("residual1", be.gated_residual(x, gate_msa, o_proj, act), "local")
    m2 = tr("norm2", be.rms_modulate_fwd(x1, rep["norm2.weight"], scale_mlp, shift_mlp, eps, act), "local")
    m2_tp = comm.gather_tp_rows(m2, "sp.gather.m2")
    h = tr("ff.hidden", be.mm(m2_tp, loc["hidden"].t(), act), "tp_units")  # [R_tp, F_local]
    g = tr("ff.gate", be.mm(m2_tp, loc["gate"].t(), act), "tp_units")
    a = tr("ff.swiglu", be.swiglu_fwd(h, g, act), "tp_units")
    root = be.unit_reduce([(a, loc["down"].t())], U)
    y = tr("ff.net.2", be.round(comm.reduce_units(root, "ff.net.2", scatter_rows=True), act), "local")
    out = tr("out", be.gated_residual(x1, gate_mlp, y, act), "local")
    clock.lap()
    active_out = torch.where(active, out, torch.zeros((), dtype=out.dtype, device=out.device))
    if not backward:
        return BlockStep(active_out, None, None, None, None, {"forward_s": clock.seconds()[0], "backward_s": 0.0})

    # ---- B11-B9 backward through ff: padding rows carry no gradient --------------------------
    g_out = torch.where(active, b.grad_out.to(torch.float32), 0.0)
    d_gate_mlp = g_out * y.to(torch.float32)
    dy = tr("d.ff.net.2", be.round(g_out * gate_mlp.to(torch.float32), act), "local")
    dy_tp = comm.gather_tp_rows(dy, "sp.gather.dy")
    dy_seq, m2_seq = seq(dy_tp, "cp.gather.dy"), seq(m2_tp, "cp.gather.m2")
    da = tr("d.ff.swiglu", be.mm(dy_tp, loc["down"], act), "tp_units")  # [R_tp, F_local]
    dh, dg = be.swiglu_bwd(da, h, g, act)
    dh, dg = tr("d.ff.hidden", dh, "tp_units"), tr("d.ff.gate", dg, "tp_units")
    root = be.unit_reduce([(dh, loc["hidden"]), (dg, loc["gate"])], U)  # hidden, then gate
    dm2 = tr("d.norm2", be.round(comm.reduce_units(root, "ff.net.0.dx", scatter_rows=True), act), "local")
    # hidden's and gate's weight gradients as one GEMM over [dh | dg] (a view of the Triton kernel's one
    # buffer; a copy on torch) into one [2 F_local, D] tensor, ff.net.0's own layout: as two GEMMs,
    # handing out ff.net.0 cost a 0.3 GB copy (0.15 ms on the H200). Per element the same chain.
    dw_ff0 = be.row_mm(seq(join([dh, dg], dim=1), "cp.gather.dhg"), m2_seq, order, w_dt)  # [2 F_local, D]
    dw_local = {
        "ff.net.2.weight": be.row_mm(dy_seq, seq(a, "cp.gather.a"), order, w_dt),  # [D, F_local]
        "ff.hidden": dw_ff0[: U * F8],  # [F_local, D]
        "ff.gate": dw_ff0[U * F8 :],
    }
    # dead from here on: the block's peak memory is at the end of the backward, so free as we go
    del h, g, a, da, dh, dg, dy, dy_tp, dy_seq, m2, m2_tp, m2_seq, y, out, dw_ff0

    # ---- B8-B6 norm2, residual 1, to_out --------------------------------------------------
    dxn2, dw_norm2, d_scale_mlp, d_shift_mlp = be.rms_modulate_bwd(dm2, x1, rep["norm2.weight"], scale_mlp, eps)
    dx1 = g_out + dxn2
    d_gate_msa = dx1 * o_proj.to(torch.float32)
    do = tr("d.attn.to_out.0", be.round(dx1 * gate_msa.to(torch.float32), act), "local")
    do_tp = comm.gather_tp_rows(do, "sp.gather.do")
    dattn = tr("d.attn.sdpa", be.mm(do_tp, loc["out"], act), "tp_units")  # [R_tp, A_local]
    dw_local["attn.to_out.0.weight"] = be.row_mm(seq(do_tp, "cp.gather.do"), seq(attn, "cp.gather.attn"), order, w_dt)
    # norm2's cross-row gradients now, so its four FP32 [R, D] row tensors go before the attention's;
    # the four chain sets in one call (on the GPU one launch: a set alone is latency-bound)
    tables = lambda ds, i0: [(d, seq_local, f"cp.gather.dtable{i}") for i, d in enumerate(ds, start=i0)]  # noqa: E731
    chains = lambda row_sets, table_sets: _chain_sums(be, row_sets, table_sets, idx_seq, 3 * T, order)  # noqa: E731
    mlp_sets = tables((d_shift_mlp, d_scale_mlp, d_gate_mlp), 3)
    (dnorm2,), d_table_mlp = chains([(dw_norm2, seq_local, "cp.gather.dnorm2")], mlp_sets)
    dnorm2 = be.round(dnorm2, rep["norm2.weight"].dtype)
    del dxn2, dw_norm2, d_shift_mlp, d_scale_mlp, d_gate_mlp, mlp_sets, dm2, x1, g_out, o_proj, do, do_tp

    # ---- B5 attention: dq for this rank's queries, dk/dv for its keys over every query -------
    dO = heads(dattn)
    delta = be.attention_delta(dO, o_ref)  # [H_local, R_tp]
    dq = be.attention_bwd_q(qr, dO, stats, delta, k_c, v_c, scale)
    gather_q = lambda t, site: seq(t.transpose(0, 1), site)[order].transpose(0, 1)  # noqa: E731  [H, R] stats
    q_c, dO_c = seq(qr, "cp.gather.q")[order], seq(dO, "cp.gather.dO")[order]
    stats_c = [gather_q(t, f"cp.gather.stats{i}") for i, t in enumerate(stats)]
    dk, dv = be.attention_bwd_kv(q_c, dO_c, stats_c, gather_q(delta, "cp.gather.delta"), kr, v, scale)
    del q_c, dO_c, stats_c, k_c, v_c, dO, dattn, delta, stats, o_ref, attn3, attn, qr, kr, v

    # ---- B4-B3 RoPE + q/k norm, then q,k,v dX (unit tree) and dW -----------------------------
    dq, dwq_rows = be.qk_norm_rope_bwd(dq, heads(q), wq, cos, sin, qk_eps, act)
    dk, dwk_rows = be.qk_norm_rope_bwd(dk, heads(k), wk, cos, sin, qk_eps, act)
    del q, k
    dq, dk, dv = dq.reshape(R_tp, -1), dk.reshape(R_tp, -1), be.round(dv, act).reshape(R_tp, -1)
    dq, dk, dv = (tr(f"d.attn.to_{n}", t, "tp_units") for n, t in (("q", dq), ("k", dk), ("v", dv)))
    root = be.unit_reduce([(dq, loc["q"]), (dk, loc["k"]), (dv, loc["v"])], U)  # q, k, v
    dm1 = tr("d.norm1", be.round(comm.reduce_units(root, "attn.qkv.dx", scatter_rows=True), act), "local")
    m1_seq = seq(m1_tp, "cp.gather.m1")
    for name, d in (("attn.to_q.weight", dq), ("attn.to_k.weight", dk), ("attn.to_v.weight", dv)):
        dw_local[name] = be.row_mm(seq(d, f"cp.gather.d{name[8]}"), m1_seq, order, w_dt)  # [A_local, D]
    del dq, dk, dv, d, m1_seq, m1_tp, m1, root

    # ---- B2 norm1, dx ------------------------------------------------------------------------
    dxn1, dw_norm1, d_scale_msa, d_shift_msa = be.rms_modulate_bwd(dm1, x, rep["norm1.weight"], scale_msa, eps)
    zero_pad = lambda t: torch.where(active, t, torch.zeros((), dtype=t.dtype, device=t.device))  # noqa: E731
    dx = tr("dx", zero_pad(be.round(dx1 + dxn1, act)), "local")

    # ---- cross-row gradients of replicated weights: rows of the whole sequence in key order, and
    # ---- B1's AdaLN table rows (segmented, key order): six chain sets in one call -------------
    # one chain per column, so six [R, D] sets give the bits of one stacked [R, 6, D] set
    # without its 6·R·D FP32 copy (0.5 GB at 4096 rows, at the block's peak memory)
    p_dt = lambda name: rep[name].dtype  # noqa: E731
    qk_rows = (("attn.norm_q.weight", dwq_rows), ("attn.norm_k.weight", dwk_rows))
    row_sets = [(dw_norm1, seq_local, "cp.gather.dnorm1")] + [(t, seq, f"cp.gather.{name}") for name, t in qk_rows]
    (dnorm1, *per_heads), d_table_msa = chains(row_sets, tables((d_shift_msa, d_scale_msa, d_gate_msa), 0))
    del row_sets
    dw_rep = {"norm1.weight": be.round(dnorm1, p_dt("norm1.weight")), "norm2.weight": dnorm2}
    for name, per_head in zip(("attn.norm_q.weight", "attn.norm_k.weight"), per_heads, strict=True):  # [H_local, Dh]
        per_unit = chain_sum(per_head.view(U, H8, -1).transpose(0, 1))  # [U, Dh]: each unit's heads ascending
        dw_rep[name] = be.round(comm.reduce_units(unit_tree(list(per_unit.unbind(0))), name), p_dt(name))

    # ---- B1 then the AdaLN projection -------------------------------------------------------
    d_table = torch.stack(d_table_msa + d_table_mlp, dim=1).reshape(T, -1)  # [T, 3 modalities x 6 x D]
    d_cols = d_table[:, units.start * G8 : units.stop * G8]  # [T, 18D/8 * local units]
    dw_local["adaln_proj.linear.weight"] = be.mm_few_k(d_cols, st, w_dt)  # timesteps ascending
    dw_local["adaln_proj.linear.bias"] = chain_sum(d_cols)
    dst = be.unit_reduce_few_rows(d_cols, loc["adaln_w"], U)
    dtemb = be.silu_bwd(comm.reduce_units(dst, "adaln.dtemb"), b.temb)

    # ---- per-unit views of this rank's weight gradients, rounded once to the weights' dtype ---
    widths = {
        "attn.to_q.weight": A8,
        "attn.to_k.weight": A8,
        "attn.to_v.weight": A8,
        "ff.hidden": F8,
        "ff.gate": F8,
        "adaln_proj.linear.weight": G8,
        "adaln_proj.linear.bias": G8,
    }
    dw: dict[str, dict[int, Tensor]] = {}
    for name, t in dw_local.items():
        t = be.round(t, w_dt)  # a no-op for the GEMM results, which rounded in their epilogue
        if name in widths:  # unit-major rows
            n = widths[name]
            dw[name] = {u: t[(u - units.start) * n : (u - units.start + 1) * n] for u in units}
        else:  # unit-major columns: to_out.0, ff.net.2
            n = A8 if name.startswith("attn") else F8
            dw[name] = {u: cols(t, u, n) for u in units}
    clock.lap()
    forward_s, backward_s = clock.seconds()
    timings = {"forward_s": forward_s, "backward_s": backward_s}
    return BlockStep(out=active_out, dx=dx, dw_units=dw, dw_replicated=dw_rep, dtemb=dtemb, timings=timings)


class _Clock:
    """Seconds between laps of one block step. On CUDA, events on the current stream, read once at the
    end (where the caller waits for the results anyway): the step is timed as the GPU ran it, and no
    lap drains the GPU's queue mid-block, as a synchronising wall clock did. On CPU, wall-clock laps."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # a CUDA graph capture (h3lab.graph) records no timing events: reading them would wait for the
        # GPU mid-capture; its laps read NaN (a replay is timed from outside)
        self.capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        self.marks = [self._mark()]

    def _mark(self) -> torch.cuda.Event | float | None:
        if self.capturing:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> list[float]:
        """Each lap's seconds; waits for the last one on CUDA (NaN for a capture)."""
        if self.capturing:
            return [float("nan")] * (len(self.marks) - 1)
        if not self.cuda:
            return [b - a for a, b in itertools.pairwise(self.marks)]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]
