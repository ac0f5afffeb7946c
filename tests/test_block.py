"""The canonical block's invariances, byte for byte, and its fail-closed checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from h3lab import H3Config, PackedBatch, canonical_block, packed_batch, synthetic_block
from h3lab.batch import ROW_FIELDS
from h3lab.comm import LocalComm
from h3lab.contract import strict_mode
from h3lab.ops.chain import chain_mm
from h3lab.ops.fixed import unit_tree
from h3lab.units import join, unit_weights
from tests.conftest import assert_bitwise


def _assert_same_result(a, b, rows_a=slice(None), rows_b=slice(None)):
    assert_bitwise(a.out[rows_a], b.out[rows_b], "out")
    assert_bitwise(a.dx[rows_a], b.dx[rows_b], "dx")
    assert_bitwise(a.dtemb, b.dtemb, "dtemb")
    assert a.dw.keys() == b.dw.keys()
    for name in a.dw:
        assert_bitwise(a.dw[name], b.dw[name], f"dw {name}")


@pytest.fixture(scope="module")
def reference(tiny_weights, tiny_batch):
    return canonical_block(tiny_weights, tiny_batch)


def test_two_runs_give_identical_bytes_and_seeds_matter(tiny, tiny_weights, tiny_batch, reference):
    _assert_same_result(canonical_block(tiny_weights, tiny_batch), reference)
    other = canonical_block(tiny_weights, packed_batch(tiny, 264, seed=13))
    assert not torch.equal(other.out, reference.out)
    assert not torch.equal(other.dw["attn.to_q.weight"], reference.dw["attn.to_q.weight"])
    other_w = canonical_block(synthetic_block(tiny, 0, seed=99), tiny_batch)
    assert not torch.equal(other_w.dx, reference.dx)


def _insert_padding(batch: PackedBatch, num: int, seed: int, poison: bool) -> tuple[PackedBatch, torch.Tensor]:
    """`batch` with `num` padding rows of arbitrary contents at random positions; returns active rows' index."""
    g = torch.Generator().manual_seed(seed)
    S, D = batch.hidden_states.shape
    pad = {
        "hidden_states": torch.randn(num, D, generator=g).to(batch.hidden_states.dtype) * 50,
        "adaln_indices": torch.randint(0, 3 * batch.num_timesteps, (num,), generator=g),
        "position_ids": torch.randint(0, 1000, (num, 3), generator=g),
        "logical_keys": torch.stack([-torch.randint(1, 9, (num,), generator=g), torch.arange(num)], 1),
        "grad_out": torch.randn(num, D, generator=g).to(batch.grad_out.dtype) * 50,
    }
    if poison:  # NaN and inf in padding must not reach an active row
        pad["hidden_states"][0, :5] = float("nan")
        pad["grad_out"][-1, :5] = float("inf")
    perm = torch.randperm(S + num, generator=g)
    fields = {k: torch.cat([getattr(batch, k), pad[k]])[perm] for k in ROW_FIELDS}
    where_active = torch.argsort(perm)[:S]  # new position of each original row
    return PackedBatch(temb=batch.temb, **fields), where_active


@pytest.mark.parametrize(("num", "poison"), [(1, False), (37, True)])
def test_padding_rows_change_nothing(tiny_weights, tiny_batch, reference, num, poison):
    padded, where = _insert_padding(tiny_batch, num, seed=num, poison=poison)
    result = canonical_block(tiny_weights, padded)
    _assert_same_result(result, reference, rows_a=where)
    pad_rows = ~padded.active
    assert (result.out[pad_rows] == 0).all() and (result.dx[pad_rows] == 0).all()


def test_row_order_changes_nothing_but_the_order(tiny_weights, tiny_batch, reference):
    perm = torch.randperm(tiny_batch.num_rows, generator=torch.Generator().manual_seed(5))
    permuted = tiny_batch.rows(perm)
    _assert_same_result(canonical_block(tiny_weights, permuted), reference, rows_b=perm)


def test_bf16_and_fp32_both_run_and_differ_by_rounding_only(tiny_weights, tiny_batch, reference):
    fp32 = canonical_block(tiny_weights.to(dtype=torch.float32), _to(tiny_batch, torch.float32))
    rel = (fp32.out.double() - reference.out.double()).norm() / fp32.out.double().norm()
    assert rel < 2e-2  # bf16 storage (eps 2^-8) over a dozen roundings, not a bug-sized difference


def _to(batch: PackedBatch, dtype: torch.dtype) -> PackedBatch:
    return dataclasses.replace(batch, hidden_states=batch.hidden_states.to(dtype), grad_out=batch.grad_out.to(dtype))


# ---- every GEMM of the block: sub-batches, column slices and TP groupings --------------------


def _gemm_operands(config: H3Config, weights, seed: int):
    """(name, x [R, K] bf16, W^T [K, N]) for the block's six projection weights at their real roles."""
    uw = unit_weights(weights)
    g = torch.Generator().manual_seed(seed)
    x = lambda k: torch.randn(264, k, generator=g).bfloat16()  # noqa: E731
    D, A, F = config.hidden_size, config.inner_dim, config.ffn_dim
    return [
        ("to_q", x(D), weights["attn.to_q.weight"].t()),
        ("ff.net.0", x(D), weights["ff.net.0.proj.weight"].t()),
        ("to_out", x(A), weights["attn.to_out.0.weight"].t()),
        ("ff.net.2", x(F), weights["ff.net.2.weight"].t()),
        ("dx to_q", x(A), weights["attn.to_q.weight"]),
        ("adaln", x(config.time_embed_dim)[:6], uw.adaln_w[3].t()),
    ]


def test_every_gemm_is_row_and_column_invariant(tiny, tiny_weights):
    for name, x, w in _gemm_operands(tiny, tiny_weights, seed=3):
        full = chain_mm(x, w)
        for rows in (slice(0, 1), slice(5, 22), slice(x.shape[0] - 3, None)):
            assert_bitwise(chain_mm(x[rows], w), full[rows], f"{name} rows {rows}")
        for cols in (slice(0, 7), slice(w.shape[1] // 2, None)):
            assert_bitwise(chain_mm(x, w[:, cols]), full[:, cols], f"{name} cols {cols}")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_unit_partials_grouped_by_tp_give_the_tp1_bytes(tiny, tiny_weights, tp):
    uw = unit_weights(tiny_weights)
    g = torch.Generator().manual_seed(tp)
    attn = torch.randn(264, tiny.inner_dim, generator=g).bfloat16()
    A8 = tiny.inner_dim // 8
    partials = [chain_mm(attn[:, u * A8 : (u + 1) * A8], uw.out[u].t()) for u in range(8)]  # to_out, row-parallel
    dq = torch.randn(264, tiny.inner_dim, generator=g).bfloat16()
    dx_partials = [  # dX of q,k,v (column-parallel): one chain per unit over its q, k, v blocks in order
        chain_mm(dq[:, s], uw.v[u], chain_mm(dq[:, s], uw.k[u], chain_mm(dq[:, s], uw.q[u])))
        for u in range(8)
        for s in [slice(u * A8, (u + 1) * A8)]
    ]
    per = 8 // tp
    for parts, what in ((partials, "to_out"), (dx_partials, "qkv dx")):
        roots = [unit_tree(parts[r * per : (r + 1) * per]) for r in range(tp)]
        assert_bitwise(unit_tree(roots), unit_tree(parts), f"{what} TP{tp}")


# ---- fail closed ---------------------------------------------------------------------------


def test_tf32_in_strict_mode_raises(tiny_weights, tiny_batch):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with pytest.raises(ValueError, match="strict mode forbids TF32"):
            canonical_block(tiny_weights, tiny_batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with pytest.raises(ValueError, match="strict mode forbids TF32"), strict_mode():
            pass
    finally:
        torch.set_float32_matmul_precision(prec)


def test_strict_mode_restores_reduced_precision_flags():
    m = torch.backends.cuda.matmul
    before = m.allow_bf16_reduced_precision_reduction
    with strict_mode():
        assert m.allow_bf16_reduced_precision_reduction is False
    assert m.allow_bf16_reduced_precision_reduction == before


def test_mismatched_shapes_and_devices_raise(tiny, tiny_weights, tiny_batch):
    wrong = packed_batch(H3Config.tiny().replace(hidden_size=96, time_embed_dim=96), 16, seed=1)
    with pytest.raises(ValueError, match="hidden_size is 192"):
        canonical_block(tiny_weights, wrong)
    with pytest.raises(ValueError, match="allowed: \\['cpu', 'cuda'\\]"):
        canonical_block(tiny_weights, tiny_batch.to("meta"))


def test_a_backend_name_is_refused_below_the_entry_point(tiny_weights, tiny_batch):
    # the block takes the object an entry point built (h3lab.backend.get_backend), never a name
    with pytest.raises(ValueError, match=r"backend 'torch' is a name; allowed: a backend object, .*get_backend"):
        canonical_block(tiny_weights, tiny_batch, backend="torch")


def test_heads_not_divisible_by_8_raise():
    with pytest.raises(ValueError, match="num_attention_heads=12 is not divisible by the 8"):
        H3Config.tiny().replace(num_attention_heads=12)


def test_unit_grads_join_without_copies_where_they_lie_end_to_end():
    base = torch.randn(6, 10)
    rows = [base[i * 2 : (i + 1) * 2] for i in range(3)]
    cols = [base[:, i * 5 : (i + 1) * 5] for i in range(2)]
    for pieces, dim in ((rows, 0), (cols, 1)):
        got = join(pieces, dim)
        assert got.data_ptr() == base.data_ptr() and torch.equal(got, base), f"dim {dim}: a view of the base"
    apart = [base[0:2], base[3:5]]  # a gap: must copy
    assert torch.equal(join(apart, 0), torch.cat(apart)) and join(apart, 0).data_ptr() != base.data_ptr()
    swapped = [base[2:4], base[0:2]]
    assert torch.equal(join(swapped, 0), torch.cat(swapped))
    other = [base[0:2], base.clone()[2:4]]  # another storage that happens to follow in memory is still copied
    assert torch.equal(join(other, 0), torch.cat(other))


def test_chain_sets_gathered_by_copy_are_summed_one_at_a_time():
    """rowspace.sum_chain_sets: a set whose gather copies (SP/CP) is summed alone at once, so one
    gathered copy is alive at a time; sets used in place go side by side in one call; the bytes are
    the single calls' either way."""
    from h3lab.backend import TorchBackend
    from h3lab.block.rowspace import sum_chain_sets

    calls = []

    class Recording(TorchBackend):
        def chain_sums(self, row_xs, segment_xs, segment_R, num_segments, order):
            calls.append((len(row_xs), len(segment_xs)))
            return super().chain_sums(row_xs, segment_xs, segment_R, num_segments, order)

    g = torch.Generator().manual_seed(7)
    R, G = 23, 4
    xs = [torch.randn(R, 6, generator=g) for _ in range(5)]
    order = torch.randperm(R, generator=g)[:19]
    segment = torch.randint(0, G, (R,), generator=g)
    same, copy = (lambda t, site: t), (lambda t, site: t.clone())
    be = Recording()
    row_sets = [(xs[0], same, "a"), (xs[1], copy, "b")]
    table_sets = [(xs[2], copy, "c"), (xs[3], same, "d"), (xs[4], same, "e")]
    sums, segs = sum_chain_sets(be, row_sets, table_sets, segment, G, order)
    assert calls == [(1, 0), (0, 1), (1, 2)], f"copied sets alone, then the in-place ones together: {calls}"
    for got, x in zip(sums, xs[:2], strict=True):
        assert_bitwise(got, be.row_sum(x, order), "row set")
    for got, x in zip(segs, xs[2:], strict=True):
        assert_bitwise(got, be.segment_sum(x, segment, G, order), "table set")


@dataclasses.dataclass
class _Call:
    name: str
    freed: set[tuple[int, int]]  # (call, output) of the calls before this one, freed by the time it starts
    outputs: list  # StorageWeakRef of each tensor it returned


def _logged(name: str, fn, log: list[_Call]):
    """`fn` with every call logged as a _Call named `name`."""

    def call(*args, **kwargs):
        from torch.multiprocessing.reductions import StorageWeakRef

        freed = {(i, o) for i, c in enumerate(log) for o, ref in enumerate(c.outputs) if ref.expired()}
        entry = _Call(name, freed, [])
        log.append(entry)
        out = fn(*args, **kwargs)
        flat = [t for o in (out if isinstance(out, tuple) else (out,)) for t in (o if isinstance(o, tuple) else (o,))]
        entry.outputs += [StorageWeakRef(t.untyped_storage()) for t in flat if isinstance(t, torch.Tensor)]
        return out

    return call


class _Watched:
    """A backend or comm whose every call is logged (h3lab.block takes either as an object)."""

    def __init__(self, inner: object, log: list[_Call]) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name: str):
        value = getattr(self._inner, name)
        if not callable(value) or name.startswith("_"):
            return value
        return _logged(name, value, self._log)


class _CopyingComm(LocalComm):
    """All units and rows, every row gather a copy: the code paths of SP and CP in one process."""

    def gather_tp_rows(self, x, site):
        return x.clone()

    def gather_seq_rows(self, x, site):
        return x.clone()


@pytest.mark.parametrize("comm", [LocalComm(), _CopyingComm()], ids=["local", "gathers-copy"])
def test_the_backward_frees_each_parts_tensors_when_the_part_reading_them_last_returns(tiny, comm, monkeypatch):
    """The block's peak memory is in its backward, so each tensor goes when the part that reads it
    last is done with it (h3lab.block.forward: lifetimes): which outputs of earlier backend and comm
    calls, and of the AdaLN rows' gathers (table_rows 0-5: shift, scale, gate of msa, then of mlp),
    are freed when each part of the backward, or a GEMM inside it, starts. Calls are named by their
    order in the step (mm 0: the AdaLN table, 4 and 5: ff.net.0's hidden and gate, 6: d SwiGLU, 7: d
    attention; gather_seq_rows 4-7: the FFN backward's)."""
    from h3lab.backend import TorchBackend
    from h3lab.block import block_step
    from h3lab.block import forward as block_forward

    log: list[_Call] = []
    monkeypatch.setattr(block_forward, "_table_rows", _logged("table_rows", block_forward._table_rows, log))
    b = packed_batch(tiny, 40, seed=21, padding=5)  # bf16: every rounding makes a new tensor
    b = b.rows(torch.randperm(b.num_rows, generator=torch.Generator().manual_seed(22)))
    uw = unit_weights(synthetic_block(tiny, 0, seed=23))
    step = block_step(uw, b, _Watched(comm, log), backend=_Watched(TorchBackend(), log))
    assert step.dx is not None and {c.name for c in log} >= {"rms_modulate_bwd", "attention_bwd"}

    def nth(name: str, n: int) -> int:
        return [i for i, c in enumerate(log) if c.name == name][n]

    def freed_by(part: tuple[str, int], *calls: tuple) -> None:
        at = log[nth(*part)]
        for name, n, *output in calls:
            i = nth(name, n)
            alive = [o for o in (output or range(len(log[i].outputs))) if (i, o) not in at.freed]
            assert not alive, f"{name} {n}: outputs {alive} still alive when {part} starts"

    # inside B11-B9, whose weight-gradient GEMMs hold the peak: SwiGLU's inputs, d SwiGLU, ff.net.2's
    # output and the FP32 sums of ff.net.0's dX go before ff.net.0's dW; dh, dg and norm2's output before ff.net.2's
    freed_by(("mm", 6), ("table_rows", 0), ("table_rows", 3), ("table_rows", 5))  # the shifts, gate_mlp
    freed_by(("row_mm", 0), ("mm", 4), ("mm", 5), ("mm", 6), ("reduce_units", 1), ("unit_reduce", 2))
    freed_by(("row_mm", 1), ("swiglu_bwd", 0), ("rms_modulate_fwd", 1), ("gather_seq_rows", 5), ("gather_seq_rows", 6))
    # inside B8-B6: scale_mlp, x1, to_out's output and d norm2's FP32 input gradient go with norm2's
    # backward, gate_msa once read; the attention's output once to_out's dW is made
    at_mm7 = [("table_rows", 2), ("table_rows", 4), ("gated_residual", 0), ("reduce_units", 0)]
    freed_by(("mm", 7), *at_mm7, ("rms_modulate_bwd", 0, 0))
    freed_by(("chain_sums", 0), ("attention_fwd", 0, 0), ("gather_seq_rows", 8), ("gather_seq_rows", 9))
    scale_msa = nth("table_rows", 1)  # read by norm1's backward: a storage of its own, alive until then
    assert (scale_msa, 0) not in log[nth("rms_modulate_bwd", 1)].freed
    ffn = [("mm", 4), ("mm", 5), ("swiglu_fwd", 0), ("rms_modulate_fwd", 1), ("swiglu_bwd", 0), ("mm", 6)]
    freed_by(("rms_modulate_bwd", 0), *ffn, *[("gather_seq_rows", i) for i in (4, 5, 6, 7)])
    to_out = [("rms_modulate_bwd", 0), ("gated_residual", 0), ("unit_reduce", 2), ("gather_seq_rows", 8)]
    freed_by(("attention_delta", 0), *to_out, ("gather_seq_rows", 9))
    attention = [("attention_fwd", 0), ("qk_norm_rope_fwd", 0), ("qk_norm_rope_fwd", 1), ("mm", 3), ("mm", 7)]
    freed_by(("qk_norm_rope_bwd", 0), *attention, ("attention_delta", 0))
    # the fused backward (no CP: one rank's TP rows are the sequence); its FP32 dq, dk, dv are put back
    # in the batch's row order (shuffled, padded: copies), so the calls' own outputs go inside B5
    freed_by(("qk_norm_rope_bwd", 0), ("attention_bwd", 0))
    freed_by(("unit_reduce", 3), ("mm", 1), ("mm", 2))  # q, k
    qkv = [("qk_norm_rope_bwd", 0, 0), ("qk_norm_rope_bwd", 1, 0), ("unit_reduce", 3), ("rms_modulate_fwd", 0)]
    freed_by(("rms_modulate_bwd", 1), *qkv)  # q, k, v's gradients (not the norm weights' rows), norm1's output


def test_the_fused_attention_gradients_go_back_to_their_rows_without_a_host_read(monkeypatch):
    """RowSpace.tp_from_order: canonical-order rows into the batch's rows, padding zero, never reading
    the order back (a sync per block backward); the order's copy is skipped only where its facts are
    known (an arange), with the same bytes."""
    from h3lab import rowplan
    from h3lab.block.rowspace import RowSpace

    def read_back(t):
        raise AssertionError("tp_from_order read the order back")

    rs, g = RowSpace(LocalComm()), torch.Generator().manual_seed(5)
    order = torch.randperm(12, generator=g)[:9]  # 3 padding rows
    t_c = torch.randn(9, 2, 4, generator=g)
    monkeypatch.setattr(rowplan, "_facts_of", read_back)
    out = rs.tp_from_order(t_c, order, 12)
    assert_bitwise(out[order], t_c)
    padding = torch.ones(12, dtype=torch.bool)
    padding[order] = False
    assert padding.sum() == 3 and not out[padding].any()
    arange = torch.arange(12)
    full = torch.randn(12, 2, 4, generator=g)
    assert_bitwise(rs.tp_from_order(full, arange, 12), full)  # facts unknown: a copy, the same bytes
    rowplan.know_facts(arange, (0, 11, True))
    assert rs.tp_from_order(full, arange, 12) is full
