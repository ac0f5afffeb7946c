"""The block step's forward in parts named after its sections (F1-F11), and the records it keeps for
the backward (h3lab.block.backward).

Lifetimes. The block's peak memory is in its backward (`python -m h3lab.bench.block_memory` names
where), so every tensor goes as soon as the last part that reads it is done with it. A record held
by a caller, or passed as an argument, keeps all its tensors until that call returns; so what goes
from one part to a later one travels on the step's `Tape` (a mutable per-step state) instead of
through the caller:
- each forward part puts, for each backward part that reads its tensors, one record on the tape: a
  frozen NamedTuple of exactly the tensors that part reads; a backward part puts what it hands the
  next part the same way;
- a part takes each of its records off the tape (popped: the tape holds it no more) and unpacks it
  into its locals, so the record itself is gone: a tensor lives until the part that reads it last
  rebinds the name (dq, dk and dv rebound to their rounded values free the FP32 ones), deletes it
  (`del` at its last read, where a part runs long after it: the weight-gradient GEMMs, the chain
  sums) or returns;
- what several parts read and what lives to the step's end anyway is returned and passed as
  arguments: `Rows` (active rows, segments, the canonical order), silu(temb), and the backward's
  results. The AdaLN rows (`Modulation`) are one gather per column, each in the records of the
  backward parts that read it: the shifts go with the forward, gate_mlp in B11-B9, gate_msa and
  scale_mlp in B8-B6, scale_msa in B2.
The parts run the step's kernels in the step's order; tests/test_block.py checks where the
backward's tensors are freed.

Dimension legend: R rows (local / TP / sequence row spaces, see h3lab.comm), D hidden, A attention
width, F SwiGLU width, E time_embed_dim, T timesteps, H heads, Dh head_dim; `_local` = this
rank's units.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol, TypeVar

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.batch import PackedBatch
from h3lab.block.rowspace import RowSpace
from h3lab.config import H3Config
from h3lab.rowplan import RowPlan
from h3lab.units import UnitWeights


class Trace(Protocol):
    """Sees every op's output in execution order, for the first-divergence finder; returns the
    tensor the block goes on with (the same one, or a planted fault in tests).

    `space` says how layouts shard it: "local" (this rank's rows), "tp_units" (TP rows x this
    rank's unit-major columns or heads), "units" (a stack of this rank's canonical units: a training
    step's gradients), "replicated" (the same on every rank).
    """

    def __call__(self, name: str, t: Tensor, space: str) -> Tensor: ...


@dataclass(frozen=True, eq=False)
class Step:
    """What every part of one block step reads: the kernels, the trace, this rank's weights and row
    spaces, the dtypes and the batch's timestep count."""

    be: Backend
    tr: Trace
    uw: UnitWeights
    rs: RowSpace
    act: torch.dtype  # activations (the batch's dtype)
    w_dt: torch.dtype  # the unit-sharded weights
    num_timesteps: int  # T

    @property
    def config(self) -> H3Config:
        return self.uw.config

    @property
    def num_units(self) -> int:  # U: the units this rank holds
        return len(self.rs.units)

    def heads(self, t_RA: Tensor) -> Tensor:
        """[R, A_local] -> [R, H_local, Dh] (a view)."""
        return t_RA.view(t_RA.shape[0], -1, self.config.attention_head_dim)


RecordT = TypeVar("RecordT", bound=tuple)


class Tape:
    """The records of one block step between its parts, each put once and taken once (see the module
    docstring): one record per type at a time."""

    def __init__(self) -> None:
        self._records: dict[type, tuple] = {}

    def put(self, record: tuple) -> None:
        assert type(record) not in self._records, f"{type(record).__name__} put twice"
        self._records[type(record)] = record

    def take(self, kind: type[RecordT]) -> RecordT:
        return self._records.pop(kind)  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._records)


class Modulation(NamedTuple):
    """The AdaLN table's rows of each local row, each [R_local, D] a gather of its own (one storage
    per column: each goes when its last reader is done)."""

    shift_msa: Tensor
    scale_msa: Tensor
    gate_msa: Tensor
    shift_mlp: Tensor
    scale_mlp: Tensor
    gate_mlp: Tensor


class Rows(NamedTuple):
    """The step's row facts, read by every cross-row part of the backward."""

    active: Tensor  # [R_local, 1] bool: not padding
    segments: Tensor  # [R_seq] each sequence row's AdaLN table row (the segment of its table sums)
    order: Tensor  # [R_active] int64: the sequence's active rows in canonical order


# ---- what each backward part reads of the forward (h3lab.block.backward) --------------------------


class FfnSaved(NamedTuple):  # B11-B9
    y: Tensor  # [R_local, D] ff.net.2's output
    m2_tp: Tensor  # [R_tp, D] norm2's output
    h: Tensor  # [R_tp, F_local] ff.net.0's hidden half
    g: Tensor  # [R_tp, F_local] its gate half
    a: Tensor  # [R_tp, F_local] SwiGLU's output
    gate_mlp: Tensor  # [R_local, D] the AdaLN rows' mlp gate


class ToOutSaved(NamedTuple):  # B8-B6
    x1: Tensor  # [R_local, D] the first residual's output
    o_proj: Tensor  # [R_local, D] to_out's output
    attn: Tensor  # [R_tp, A_local] the attention's output, to_out's input
    gate_msa: Tensor  # [R_local, D] the first residual's AdaLN gate
    scale_mlp: Tensor  # [R_local, D] norm2's AdaLN scale


class AttentionSaved(NamedTuple):  # B5
    qr: Tensor  # [R_tp, H_local, Dh] queries after q norm + RoPE
    kr: Tensor  # [R_tp, H_local, Dh] keys after k norm + RoPE
    v: Tensor  # [R_tp, H_local, Dh]
    k_c: Tensor  # [R_active, H_local, Dh] the sequence's keys in canonical order
    v_c: Tensor
    o_ref: Tensor  # the attention's output as the backend's delta reads it
    stats: tuple[Tensor, ...]  # per-(head, query) [H_local, R_tp]


class QkSaved(NamedTuple):  # B4
    q: Tensor  # [R_tp, A_local] to_q's output
    k: Tensor  # [R_tp, A_local] to_k's output
    cos: Tensor  # [R_tp, 6 rope_freq_dim] FP32
    sin: Tensor


class QkvSaved(NamedTuple):  # B3
    m1_tp: Tensor  # [R_tp, D] norm1's output


class Norm1Saved(NamedTuple):  # B2
    scale_msa: Tensor  # [R_local, D] norm1's AdaLN scale


class Forward(NamedTuple):
    out: Tensor  # [R_local, D] the block's output; padding rows not yet zeroed
    rows: Rows
    st: Tensor  # [T, E] silu(temb) in the weights' dtype: the AdaLN projection's input
    tape: Tape  # one record per backward part


def forward(step: Step, b: PackedBatch, decided_rows: RowPlan | None) -> Forward:
    """F1-F11 on this rank's rows and units."""
    active, segments, pos_tp, order_when_ready = _row_metadata(step, b, decided_rows)
    st, mod = _adaln_table(step, b)
    tape = Tape()
    attn, order = _attention_forward(step, b.hidden_states, mod, pos_tp, order_when_ready, tape)
    out = _ffn_forward(step, b.hidden_states, attn, mod, tape)
    return Forward(out, Rows(active, segments, order), st, tape)


def _row_metadata(
    step: Step, b: PackedBatch, decided_rows: RowPlan | None
) -> tuple[Tensor, Tensor, Tensor, Callable[[], Tensor]]:
    """(active local rows, segments of the sequence rows, positions of the TP rows, the canonical
    order when ready): the row metadata in the three row spaces."""
    rs, keys = step.rs, b.logical_keys
    active = (keys[:, 0] >= 0).unsqueeze(1)
    keys_seq = rs.seq_local(keys, "meta.keys")
    segments = rs.seq_local(b.adaln_indices, "meta.adaln")
    pos_tp = rs.tp(b.position_ids, "meta.pos")
    # the canonical order of every cross-row reduction, with every index check of the block (RoPE's
    # too), is read after the q/k/v GEMMs are queued: on the GPU a check is a host sync, which drains
    # the queue, and each check syncing where it was needed would leave the GPU idle (python -m
    # h3lab.bench.sync_sites names every host sync of a step)
    order_when_ready = step.be.plan_rows(keys_seq, segments, 3 * step.num_timesteps, pos_tp, decided=decided_rows)
    return active, segments, pos_tp, order_when_ready


def _adaln_table(step: Step, b: PackedBatch) -> tuple[Tensor, Modulation]:
    """F1 the AdaLN table: silu(temb) in FP32, one cast to the projection's dtype (diffusers); the
    table's rows of each local row, one gather per column (the bytes of one gather of all six)."""
    be, loc, w_dt = step.be, step.uw.local, step.w_dt
    st = be.silu(b.temb, w_dt)
    table_local = be.round(be.mm(st, loc["adaln_w"].t()) + loc["adaln_b"].to(torch.float32), w_dt)
    table = step.rs.comm.gather_units(table_local, "adaln.table", dim=1)
    table = step.tr("adaln.table", table.view(3 * step.num_timesteps, 6, step.config.hidden_size), "replicated")
    return st, Modulation(*(_table_rows(table, b.adaln_indices, column) for column in range(6)))


def _table_rows(table: Tensor, segment_R: Tensor, column: int) -> Tensor:
    """[R_local, D]: the AdaLN table's rows of each local row, one of its six columns (a copy)."""
    return table[segment_R, column]


def _attention_forward(
    step: Step, x: Tensor, mod: Modulation, pos_tp: Tensor, order_when_ready: Callable[[], Tensor], tape: Tape
) -> tuple[Tensor, Tensor]:
    """F2-F5 norm1, q/k/v (this rank's units in one GEMM each), q/k norm + RoPE, attention: (the
    attention's output [R_tp, A_local], the canonical order)."""
    be, tr, rs, c, act = step.be, step.tr, step.rs, step.config, step.act
    rep, loc = step.uw.replicated, step.uw.local
    m1 = be.rms_modulate_fwd(x, rep["norm1.weight"], mod.scale_msa, mod.shift_msa, c.norm_eps, act)
    m1_tp = rs.tp(tr("norm1", m1, "local"), "sp.gather.m1")
    q = tr("attn.to_q", be.mm(m1_tp, loc["q"].t(), act), "tp_units")  # [R_tp, A_local]
    k = tr("attn.to_k", be.mm(m1_tp, loc["k"].t(), act), "tp_units")
    v = tr("attn.to_v", step.heads(be.mm(m1_tp, loc["v"].t(), act)), "tp_units")
    order = order_when_ready()
    if order.numel() == 0:  # a rank's shard may be all padding, the sequence may not
        raise ValueError("logical_keys: every row of the sequence is padding; need at least one active row")
    cos, sin = be.rope_tables(pos_tp, c.rope_freq_dim, c.rope_theta)  # [R_tp, 6f] FP32
    wq, wk, qk_eps = rep["attn.norm_q.weight"], rep["attn.norm_k.weight"], c.qk_norm_eps
    qr = tr("attn.norm_q+rope", be.qk_norm_rope_fwd(step.heads(q), wq, cos, sin, qk_eps, act), "tp_units")
    kr = tr("attn.norm_k+rope", be.qk_norm_rope_fwd(step.heads(k), wk, cos, sin, qk_eps, act), "tp_units")
    k_c = rs.seq_in_order(kr, "cp.gather.k", order)  # keys in canonical order, padding dropped
    v_c = rs.seq_in_order(v, "cp.gather.v", order)
    attn3, o_ref, stats = be.attention_fwd(qr, k_c, v_c, 1.0 / c.attention_head_dim**0.5, act)
    attn = tr("attn.sdpa", attn3.reshape(m1_tp.shape[0], -1), "tp_units")  # [R_tp, A_local]
    tape.put(AttentionSaved(qr, kr, v, k_c, v_c, o_ref, stats))
    tape.put(QkSaved(q, k, cos, sin))
    tape.put(QkvSaved(m1_tp))
    tape.put(Norm1Saved(mod.scale_msa))
    return attn, order


def _ffn_forward(step: Step, x: Tensor, attn: Tensor, mod: Modulation, tape: Tape) -> Tensor:
    """F6-F11 to_out, residual, norm2, SwiGLU, ff.net.2, residual: the block's output [R_local, D]."""
    be, tr, rs, act, U = step.be, step.tr, step.rs, step.act, step.num_units
    rep, loc = step.uw.replicated, step.uw.local
    root = be.unit_reduce([(attn, loc["out"].t())], U)
    rnd = partial(be.round, dtype=act)  # runs on each owner's sums before they are shared
    o_proj = tr("attn.to_out.0", rs.comm.reduce_units(root, "attn.to_out.0", scatter_rows=True, then=rnd), "local")
    x1 = tr("residual1", be.gated_residual(x, mod.gate_msa, o_proj, act), "local")
    m2 = be.rms_modulate_fwd(x1, rep["norm2.weight"], mod.scale_mlp, mod.shift_mlp, step.config.norm_eps, act)
    m2_tp = rs.tp(tr("norm2", m2, "local"), "sp.gather.m2")
    h = tr("ff.hidden", be.mm(m2_tp, loc["hidden"].t(), act), "tp_units")  # [R_tp, F_local]
    g = tr("ff.gate", be.mm(m2_tp, loc["gate"].t(), act), "tp_units")
    a = tr("ff.swiglu", be.swiglu_fwd(h, g, act), "tp_units")
    root = be.unit_reduce([(a, loc["down"].t())], U)
    y = tr("ff.net.2", rs.comm.reduce_units(root, "ff.net.2", scatter_rows=True, then=rnd), "local")
    out = tr("out", be.gated_residual(x1, mod.gate_mlp, y, act), "local")
    tape.put(ToOutSaved(x1, o_proj, attn, mod.gate_msa, mod.scale_mlp))
    tape.put(FfnSaved(y, m2_tp, h, g, a, mod.gate_mlp))
    return out


def zero_padding(active: Tensor, t: Tensor) -> Tensor:
    """`t` [R_local, ...] with the rows that are not `active` set to +0."""
    return torch.where(active, t, torch.zeros((), dtype=t.dtype, device=t.device))
