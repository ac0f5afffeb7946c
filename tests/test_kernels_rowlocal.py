"""Row-local and cross-row Triton kernels (h3lab.triton.norm, elementwise, rows, backend) against
their torch references in h3lab.ops, bit for bit; the row plan they read (h3lab.rowplan).

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set below before triton
is imported) on float32 CPU tensors: the interpreter's bfloat16 arithmetic is wrong. With CUDA the
same tests run compiled on the GPU, and the `gpu` tests add bf16 at the block's real widths.

Bits, not tolerances: the norms sum a row by the reference's pair tree and sigmoid uses the
reference's exp, so every kernel equals its reference exactly. One caveat: torch.sqrt on CPU
(torch 2.13 + MKL) is not correctly rounded (~17% of float32 inputs 1 ULP off; CUDA's is IEEE), so
the norm references run under `_ieee_sqrt`: sqrt in float64, then one rounding. That is correctly
rounded for every float32 input: a float32's square root lies at least 2^-51 (relative) from a
float32 rounding boundary, farther than the float64 sqrt's error (under 1 ULP = 2^-52; checked:
0 of 10^6 differ). Against the unpatched reference the norms agree within a stated tolerance.

No BLAS either: the row-local kernels have no tl.dot, and the GEMMs that row_mm and the whole block
step run take tests/conftest.py's chain_dot under the interpreter (one FP32 chain from the
accumulator, k ascending, numpy elementwise ops), so their bits are the same on every CPU and
row_mm's are the torch chain's. (The interpreter's own tl.dot multiplies bf16 operands as their
uint16 bit patterns: the block step's AdaLN table, bf16 silu(temb) @ bf16 weight, came out ~1e11.)
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
from collections.abc import Iterator

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and h3lab.triton are imported
triton = pytest.importorskip(
    "triton", reason="triton is not installed: its kernels can be neither built nor interpreted"
)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from h3lab import rowplan  # noqa: E402
from h3lab.backend import Backend, get_backend  # noqa: E402
from h3lab.metrics import bit_pattern  # noqa: E402
from h3lab.ops import elementwise as ref_elementwise  # noqa: E402
from h3lab.ops import norm as ref_norm  # noqa: E402
from h3lab.ops import rope as ref_rope  # noqa: E402
from h3lab.ops import rows as ref_rows  # noqa: E402
from h3lab.ops.fixed import cos_sin, round_to  # noqa: E402
from h3lab.rowplan import index_cache  # noqa: E402
from h3lab.triton import configs, elementwise, norm, rope, rows  # noqa: E402
from h3lab.triton.backend import TritonBackend  # noqa: E402
from h3lab.units import join  # noqa: E402

if isinstance(norm._rms_modulate_kernel, InterpretedFunction) == CUDA:
    pytest.skip(
        "h3lab.triton was imported in the wrong mode for this machine (CUDA: compiled; no CUDA: "
        f"TRITON_INTERPRET=1; found TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}, set by the environment or "
        "a module collected earlier): run `pytest tests/test_kernels_rowlocal.py` on its own",
        allow_module_level=True,
    )

DEV = torch.device("cuda" if CUDA else "cpu")
NODE = None if CUDA else "sm90"  # the interpreter names its node type; CUDA devices know theirs
F32, BF16 = torch.float32, torch.bfloat16
EPS = 1e-6
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# tl.dot under the interpreter: our FP32 chain, not the host BLAS (tests/conftest.py chain_dot)
pytestmark = pytest.mark.usefixtures("chain_dot")


# ---- helpers --------------------------------------------------------------------------------------


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@contextlib.contextmanager
def _ieee_sqrt() -> Iterator[None]:
    sqrt = torch.sqrt
    torch.sqrt = lambda t: sqrt(t.to(torch.float64)).to(t.dtype)
    try:
        yield
    finally:
        torch.sqrt = sqrt


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Identical bits; NaN only where the reference has NaN (payloads differ: CUDA's NaN is canonical)."""
    actual = actual.cpu()
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (what, actual.dtype, actual.shape)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
    mismatch = (bit_pattern(actual) != bit_pattern(expected)) & ~nan
    assert not mismatch.any(), f"{what}: {int(mismatch.sum())} of {actual.numel()} elements differ"


def _table_rows(R: int, D: int, seed: int, dtype: torch.dtype = F32) -> tuple[torch.Tensor, ...]:
    """shift, scale, gate as the block gets them: strided [R, D] slices of gathered table rows [R, 6, D]."""
    table = _randn(R, 6, D, seed=seed, scale=0.5).to(DEV, dtype)
    return table.unbind(1)[:3]


def _cpu(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.cpu() for t in ts]


# ---- norm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", [1, 3, 37])
@pytest.mark.parametrize("D", [192, 100])
def test_rms_modulate_equals_reference(R, D):
    x, w, dm = _randn(R, D, seed=1, scale=3.0).to(DEV), _randn(D, seed=2).to(DEV), _randn(R, D, seed=3).to(DEV)
    shift, scale, _ = _table_rows(R, D, seed=4)
    assert scale.stride(0) == 6 * D  # the kernels read the table's rows in place
    out = norm.rms_modulate_fwd(x, w, scale, shift, EPS, F32, node=NODE)
    grads = norm.rms_modulate_bwd(dm, x, w, scale, EPS, node=NODE)
    with _ieee_sqrt():
        ref = ref_norm.rms_modulate_fwd(*_cpu(x, w, scale, shift), EPS)
        ref_grads = ref_norm.rms_modulate_bwd(*_cpu(dm, x, w, scale), EPS)
    _same(out, ref, "out")
    for name, got, want in zip(("dx", "dw_rows", "dscale", "dshift"), grads, ref_grads, strict=True):
        _same(got, want, name)
    # the unpatched reference's CPU sqrt is up to 1 ULP off: the rows then differ by a few ULP
    torch.testing.assert_close(
        out.cpu(), ref_norm.rms_modulate_fwd(*_cpu(x, w, scale, shift), EPS), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("R", [1, 3, 37])
@pytest.mark.parametrize(("Dh", "C"), [(32, 24), (20, 12)])
def test_qk_norm_rope_equals_reference(R, Dh, C):
    H = 3
    q, w = _randn(R, H, Dh, seed=5, scale=2.0).to(DEV), _randn(Dh, seed=6).to(DEV)
    dout = _randn(H, R, Dh, seed=7).to(DEV).transpose(0, 1)  # strided [R, H, Dh], as head-major grads come
    cos, sin = (t.to(DEV) for t in cos_sin(_randn(R, C, seed=8, scale=5.0)))
    out = norm.qk_norm_rope_fwd(q, w, cos, sin, EPS, F32, node=NODE)
    dq, dw_rows = norm.qk_norm_rope_bwd(dout, q, w, cos, sin, EPS, F32, node=NODE)
    with _ieee_sqrt():
        ref = ref_norm.qk_norm_rope_fwd(*_cpu(q, w, cos, sin), EPS)
        ref_dq, ref_dw = ref_norm.qk_norm_rope_bwd(*_cpu(dout, q, w, cos, sin), EPS)
    _same(out, ref, "out")
    _same(dq, ref_dq, "dq")
    _same(dw_rows, ref_dw, "dw_rows")
    torch.testing.assert_close(out.cpu(), ref_norm.qk_norm_rope_fwd(*_cpu(q, w, cos, sin), EPS), rtol=1e-5, atol=1e-5)


# ---- elementwise --------------------------------------------------------------------------------

_EDGES = [0.0, -0.0, math.inf, -math.inf, 88.7, -88.7, 103.9, -104.0, 1e-40, -1e-40, 1000.0, -1000.0, 3e38, -3e38]


@pytest.mark.parametrize(("R", "N"), [(1, 100), (3, 192), (37, 100)])
def test_swiglu_and_gated_residual_equal_reference(R, N):
    h, da, y = (_randn(R, N, seed=s, scale=3.0) for s in (10, 11, 12))
    g = _randn(R, N, seed=13, scale=12.0)  # through sigmoid's saturation on both sides
    g[0, : len(_EDGES)] = torch.tensor(_EDGES[:N])
    h, g, da, y = (t.to(DEV) for t in (h, g, da, y))
    _, _, gate = _table_rows(R, N, seed=14)
    ref_dh, ref_dg = ref_elementwise.swiglu_bwd(*_cpu(da, h, g))
    _same(elementwise.swiglu_fwd(h, g, F32, node=NODE), ref_elementwise.swiglu_fwd(*_cpu(h, g)), "swiglu")
    dh, dg = elementwise.swiglu_bwd(da, h, g, F32, node=NODE)
    _same(dh, ref_dh, "dh")
    _same(dg, ref_dg, "dg")
    dhg = join([dh, dg], dim=1)  # side by side in one buffer: the block's ff.net.0 dW reads them without a copy
    assert dhg.data_ptr() == dh.data_ptr() and dhg.untyped_storage().data_ptr() == dg.untyped_storage().data_ptr()
    _same(dhg, torch.cat([ref_dh, ref_dg], dim=1), "[dh | dg]")
    _same(
        elementwise.gated_residual(h, gate, y, F32, node=NODE),
        ref_elementwise.gated_residual(*_cpu(h, gate, y)),
        "residual",
    )


@pytest.mark.parametrize(("T", "E"), [(1, 100), (3, 192)])
def test_silu_and_its_backward_equal_reference(T, E):
    x = _randn(T, E, seed=15, scale=12.0)  # temb: through sigmoid's saturation on both sides
    x[0, : len(_EDGES)] = torch.tensor(_EDGES[:E])
    dy = _randn(T, E, seed=16, scale=3.0)
    x, dy = x.to(DEV), dy.to(DEV)
    _same(elementwise.silu(x, F32, node=NODE), ref_elementwise.silu(x.cpu()), "silu")
    _same(elementwise.silu_bwd(dy, x, node=NODE), ref_elementwise.silu_bwd(*_cpu(dy, x)), "silu_bwd")
    if CUDA:  # the interpreter's bf16 casts are not RNE (module docstring); CUDA's are
        _same(elementwise.silu(x, BF16, node=NODE), round_to(ref_elementwise.silu(x.cpu()), BF16), "silu bf16")


@pytest.mark.parametrize("R", [1, 3, 37])
@pytest.mark.parametrize(("f", "theta"), [(4, 10000.0), (16, 256.0)])
def test_rope_tables_equal_reference(R, f, theta):
    g = torch.Generator().manual_seed(17 + R)
    pos = torch.randint(-3000, 3000, (R, 3), generator=g)
    pos[0] = torch.tensor([999_999, -999_999, 0])  # the largest angles the reference allows
    # the pipeline's fractional grid (below 0.9 past the integer: 999_999.97 would round to 1e6 in float32)
    frac = pos.double() + 0.9 * torch.rand(R, 3, generator=g, dtype=torch.float64)
    frac[-1] = torch.tensor([-0.0, -1e-60, -0.2])  # signed zeros: torch.round(-0.2) is -0, sin(-0) is -0
    for p in (pos, frac, pos.t().contiguous().t()):  # int64, float64, a column-major [R, 3] view
        cos, sin = rope.rope_tables(p.to(DEV), f, theta, node=NODE)
        want_cos, want_sin = ref_rope.rope_tables(p, f, theta)
        _same(cos, want_cos, f"cos {p.dtype}")
        _same(sin, want_sin, f"sin {p.dtype}")


def test_rope_tables_refuse_what_the_reference_refuses():
    pos = torch.tensor([[1_000_000, 0, 0]])
    with pytest.raises(ValueError, match="allowed below 1e6"):
        ref_rope.rope_tables(pos, 4, 10000.0)
    for p, match in (
        (pos, "allowed below 1e6"),
        (-pos, "allowed below 1e6"),
        (pos[:, :2], r"\[R, 3\]"),
        (pos.int(), "int64 or float64"),
    ):
        with pytest.raises(ValueError, match=match):
            rope.rope_tables(p.to(DEV), 4, 10000.0, node=NODE)


def test_nan_propagates_and_round_is_rne():
    g = torch.tensor([[math.nan, 1.0, -math.nan, 2.0]], device=DEV)
    assert torch.isnan(elementwise.swiglu_fwd(torch.ones_like(g), g, F32, node=NODE)).cpu().tolist() == [
        [True, False, True, False]
    ]
    x = torch.tensor([1.00390625, 1.01171875, -1e-40, 3.3961e38], device=DEV)  # ties to even, denormal, overflow
    _same(elementwise.round(x, BF16), round_to(x.cpu(), BF16), "round")


# ---- rows ---------------------------------------------------------------------------------------


def _rows_case(R: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, 3, 50] spanning 6 decades (order-sensitive sums), a key order dropping ~1/4 rows, segments."""
    x = _randn(R, 3, 50, seed=seed) * torch.logspace(-3, 3, 50)
    x[0, 0, :3] = torch.tensor([-0.0, math.inf, 1e-40])
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(R, generator=g)[: max(1, R - R // 4)]
    segment = torch.randint(0, 5, (R,), generator=g)
    return x, order, segment


@pytest.mark.parametrize("R", [1, 3, 37])
def test_row_sum_and_segment_sum_equal_reference(R):
    x, order, segment = _rows_case(R, seed=20)
    xd, od, sd = x.to(DEV), order.to(DEV), segment.to(DEV)
    _same(rows.row_sum(xd, od, node=NODE), ref_rows.row_sum(x, order), "row_sum")
    _same(rows.segment_sum(xd, sd, 7, od, node=NODE), ref_rows.segment_sum(x, segment, 7, order), "segment_sum")
    arange = torch.arange(R)
    _same(rows.row_sum(xd, arange.to(DEV), node=NODE), ref_rows.row_sum(x, arange), "row_sum in place")


def test_chain_sums_are_the_single_calls():
    """Several chain sets in one launch (row sums and segment sums, mixed dtypes and widths, more sets
    than one launch takes) give each set's reference bits: the sets never meet."""
    R = 37
    x, order, segment = _rows_case(R, seed=24)
    row_xs = [x, _randn(R, 70, seed=25).to(BF16), _randn(R, 130, seed=26)] * 2 + [x[:, 1]]  # 7 sets: two launches
    seg_xs = [_randn(R, 45, seed=27), x]
    dev = lambda ts: [t.to(DEV) for t in ts]  # noqa: E731
    sums, segs = rows.chain_sums(dev(row_xs), dev(seg_xs), segment.to(DEV), 5, order.to(DEV), node=NODE)
    for i, (t, got) in enumerate(zip(row_xs, sums, strict=True)):
        _same(got, ref_rows.row_sum(t, order), f"row set {i}")
    for i, (t, got) in enumerate(zip(seg_xs, segs, strict=True)):
        _same(got, ref_rows.segment_sum(t, segment, 5, order), f"segment set {i}")
    assert rows.chain_sums([], [], segment.to(DEV), 5, order.to(DEV), node=NODE) == ([], [])
    with pytest.raises(ValueError, match=r"segment_xs: rows \[37, 36\]; allowed: all 37"):
        rows.chain_sums([], dev([x, x[:36]]), segment.to(DEV), 5, order.to(DEV), node=NODE)


def test_row_reductions_ignore_physical_order_and_padding():
    R = 37
    x, order, segment = _rows_case(R, seed=21)
    a, b = _randn(R, 9, seed=22).to(DEV), _randn(R, 11, seed=23).to(DEV)
    x, order, segment = x.to(DEV), order.to(DEV), segment.to(DEV)
    perm = torch.randperm(R + 5, generator=torch.Generator().manual_seed(24)).to(DEV)  # 5 padding rows
    where = torch.argsort(perm)  # physical position of logical row i
    pad = lambda t: torch.cat([t, torch.full((5, *t.shape[1:]), 7, dtype=t.dtype, device=DEV)])[perm]  # noqa: E731
    order_p = where[order]
    _same(rows.row_sum(pad(x), order_p, node=NODE), rows.row_sum(x, order, node=NODE).cpu(), "row_sum")
    got = rows.segment_sum(pad(x), pad(segment), 7, order_p, node=NODE)
    _same(got, rows.segment_sum(x, segment, 7, order, node=NODE).cpu(), "segment_sum")
    _same(rows.row_mm(pad(a), pad(b), order_p, node=NODE), rows.row_mm(a, b, order, node=NODE).cpu(), "row_mm")


def test_row_mm_matches_reference():
    R = 37
    a, b = _randn(R, 9, seed=25), _randn(R, 11, seed=26)
    order = torch.randperm(R, generator=torch.Generator().manual_seed(27))[:30]
    got = rows.row_mm(a.to(DEV), b.to(DEV), order.to(DEV), node=NODE)
    if CUDA:  # the GEMM's tensor-core / tile order is its own: close to the chain, not its bits
        torch.testing.assert_close(got.cpu(), ref_rows.row_mm(a, b, order), rtol=1e-5, atol=1e-5)
    else:  # the interpreter's tl.dot is the chain (chain_dot): the kernel's rows and K order give its bits
        _same(got, ref_rows.row_mm(a, b, order), "the chain over the rows in key order")
    empty = rows.row_mm(a.to(DEV), b.to(DEV), order[:0].to(DEV), node=NODE)
    _same(empty, torch.zeros(9, 11), "no active row")


# ---- invariances ------------------------------------------------------------------------------


def _row_local_calls(R: int, D: int, seed: int) -> dict[str, object]:
    x, w, dm, y = (
        _randn(R, D, seed=seed).to(DEV),
        _randn(D, seed=seed + 1).to(DEV),
        *(_randn(R, D, seed=seed + s).to(DEV) for s in (2, 3)),
    )
    shift, scale, gate = _table_rows(R, D, seed=seed + 4)
    H, Dh, C = 3, 32, 24
    q, dq = _randn(R, H, Dh, seed=seed + 5).to(DEV), _randn(R, H, Dh, seed=seed + 6).to(DEV)
    wq = _randn(Dh, seed=seed + 7).to(DEV)
    cos, sin = (t.to(DEV) for t in cos_sin(_randn(R, C, seed=seed + 8, scale=5.0)))
    return {  # name -> (function of a row slice, returning a tuple of row tensors)
        "rms_fwd": lambda s: (norm.rms_modulate_fwd(x[s], w, scale[s], shift[s], EPS, F32, node=NODE),),
        "rms_bwd": lambda s: norm.rms_modulate_bwd(dm[s], x[s], w, scale[s], EPS, node=NODE),
        "qk_fwd": lambda s: (norm.qk_norm_rope_fwd(q[s], wq, cos[s], sin[s], EPS, F32, node=NODE),),
        "qk_bwd": lambda s: norm.qk_norm_rope_bwd(dq[s], q[s], wq, cos[s], sin[s], EPS, F32, node=NODE),
        "swiglu_fwd": lambda s: (elementwise.swiglu_fwd(x[s], y[s], F32, node=NODE),),
        "swiglu_bwd": lambda s: elementwise.swiglu_bwd(dm[s], x[s], y[s], F32, node=NODE),
        "residual": lambda s: (elementwise.gated_residual(x[s], gate[s], y[s], F32, node=NODE),),
    }


def test_a_rows_bits_do_not_depend_on_which_rows_share_the_call():
    R = 13  # the interpreter runs a program at a time: rows are seconds
    for name, call in _row_local_calls(R, 100, seed=30).items():
        whole = call(slice(None))
        parts = [call(slice(a, b)) for a, b in ((0, 1), (1, 4), (4, R))]
        for i, full in enumerate(whole):
            _same(torch.cat([p[i] for p in parts]), full.cpu(), f"{name}[{i}]")


_ALT_CONFIGS = {
    "norm": {
        "rms_modulate_fwd": {"rows_per_program": 4, "num_warps": 2},
        "rms_modulate_bwd": {"rows_per_program": 2},
        "qk_norm_rope": {"heads_per_program": 2},
    },
    "elementwise": {"block_n": 32},
    "rows": {"block_n": 16, "unroll": 3},
}


def test_bits_do_not_depend_on_the_pinned_tiles(monkeypatch):
    R, D = 13, 100
    calls = _row_local_calls(R, D, seed=40)
    x, order, segment = (t.to(DEV) for t in _rows_case(R, seed=41))
    pinned = {name: call(slice(None)) for name, call in calls.items()}
    pinned_rows = (rows.row_sum(x, order, node=NODE), rows.segment_sum(x, segment, 7, order, node=NODE))
    original = configs.pinned

    def alternative(kernel: str, node: str) -> dict:
        cfg = original(kernel, node)
        for key, value in _ALT_CONFIGS.get(kernel, {}).items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
        return cfg

    monkeypatch.setattr(configs, "pinned", alternative)
    for name, call in calls.items():
        for i, (got, want) in enumerate(zip(call(slice(None)), pinned[name], strict=True)):
            _same(got, want.cpu(), f"{name}[{i}]")
    _same(rows.row_sum(x, order, node=NODE), pinned_rows[0].cpu(), "row_sum")
    _same(rows.segment_sum(x, segment, 7, order, node=NODE), pinned_rows[1].cpu(), "segment_sum")


# ---- fail closed ------------------------------------------------------------------------------


def test_bad_inputs_raise():
    x, w = torch.randn(3, 100, device=DEV), torch.randn(100, device=DEV)
    cos = torch.zeros(3, 24, device=DEV)
    q = torch.randn(3, 2, 32, device=DEV)
    order = torch.arange(3, device=DEV)
    wide = torch.zeros(1, 8193, device=DEV)  # pads to 16384, past the pinned 8192-wide row tile
    cases = [
        (lambda: norm.rms_modulate_fwd(x, w, x, x, EPS, torch.float16, node=NODE), "out_dtype"),
        (lambda: norm.rms_modulate_fwd(x, w[:99], x, x, EPS, F32, node=NODE), r"allowed: x, scale"),
        (lambda: norm.rms_modulate_bwd(x, x, w, x[:2], EPS, node=NODE), r"allowed: x, scale"),
        (lambda: norm.rms_modulate_fwd(x.int(), w, x, x, EPS, F32, node=NODE), "dtype"),
        (lambda: norm.rms_modulate_fwd(wide, wide[0], wide, wide, EPS, F32, node=NODE), r"allowed: D <= 8192"),
        (lambda: norm.qk_norm_rope_fwd(q, w[:32], cos[:, :5], cos[:, :5], EPS, F32, node=NODE), "even C"),
        (lambda: norm.qk_norm_rope_fwd(q, w[:32], cos.double(), cos.double(), EPS, F32, node=NODE), "float32 tables"),
        (lambda: norm.qk_norm_rope_bwd(q[:2], q, w[:32], cos, cos, EPS, F32, node=NODE), "allowed: q, dout"),
        (lambda: norm.rms_modulate_fwd(x, w, x, x, EPS, F32, node="sm70"), "pinned configuration"),
        (lambda: elementwise.swiglu_fwd(x, x[:2], F32, node=NODE), r"allowed: \[R, N\]"),
        (lambda: elementwise.gated_residual(x, x, x.long(), BF16, node=NODE), "dtype"),
        (lambda: elementwise.swiglu_bwd(x, x, x, torch.float16, node=NODE), "out_dtype"),
        (lambda: elementwise.round(x, torch.float16), "allowed"),
        (lambda: rows.row_sum(x, order.int(), node=NODE), "int64"),
        (lambda: rows.row_sum(x, order + 1, node=NODE), r"allowed: \[0, 3\)"),
        (lambda: rows.segment_sum(x, order, 2, order, node=NODE), r"allowed: \[0, 2\)"),
        (lambda: rows.segment_sum(x, order[:2], 3, order, node=NODE), "segment_R"),
        (lambda: rows.row_mm(x, x[:2], order, node=NODE), r"allowed: \[R, N\], \[R, K\]"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_index_checks_are_cached_but_never_stale():
    """Inside index_cache() one host sync per index tensor, yet an in-place change or a new tensor is re-checked."""
    x = torch.randn(5, 4, device=DEV)
    with index_cache():
        order = torch.tensor([4, 0, 2], device=DEV)
        ref = rows.row_sum(x, order, node=NODE)
        calls = []
        real = torch.Tensor.tolist
        with pytest.MonkeyPatch.context() as mp:  # a second check of the same tensor would sync again
            mp.setattr(torch.Tensor, "tolist", lambda t: calls.append(1) or real(t))
            _same(rows.row_sum(x, order, node=NODE), ref.cpu(), "cached")
        assert calls == [], "the cached order was checked again"
        order[0] = 5  # same tensor object, bumped version: must not pass on the cached bounds
        with pytest.raises(ValueError, match=r"order: values in \[0, 5\]; allowed: \[0, 5\)"):
            rows.row_sum(x, order, node=NODE)
        ident = torch.arange(5, device=DEV)
        in_place = rows.row_mm(x, x, ident, node=NODE)  # cached as the identity: x used in place
        ident[4] = 0  # rows 0, 1, 2, 3, 0 now: row_mm must gather
        repeated = x[[0, 1, 2, 3, 0]]
        got = rows.row_mm(x, x, ident, node=NODE)
        _same(got, rows.row_mm(repeated, repeated, torch.arange(5, device=DEV), node=NODE).cpu(), "re-checked")
        assert not torch.equal(got, in_place)
        seg, every = torch.tensor([0, 1, 0, 1, 1], device=DEV), torch.arange(5, device=DEV)
        rows.segment_sum(x, seg, 2, every, node=NODE)  # caches the segment layout of (seg, every)
        seg[0] = 1  # rows 0, 1, 3, 4 now form segment 1: the layout must be rebuilt
        got = rows.segment_sum(x, seg, 2, every, node=NODE)
        _same(got[1], rows.row_sum(x, torch.tensor([0, 1, 3, 4], device=DEV), node=NODE).cpu(), "segment 1")


def test_the_plan_decides_on_the_host_and_leaves_no_sync_for_the_reductions():
    """plan_rows gives the reference's key order; after it, the block's reductions with that order and
    those segments, and RoPE with those positions, check nothing again (no host sync) and give the
    bits they give without it."""
    R, G = 37, 5
    x, _, segment = _rows_case(R, seed=90)
    g = torch.Generator().manual_seed(91)
    keys = torch.stack([torch.randint(-1, 3, (R,), generator=g), torch.randperm(R, generator=g)], dim=1)
    segment = torch.where(keys[:, 0] < 0, 99, segment).int()  # padding may carry any segment; int32 allowed
    pos = torch.randint(-500, 500, (R, 3), generator=g)
    x, keys, segment, pos = x.to(DEV), keys.to(DEV), segment.to(DEV), pos.to(DEV)
    with index_cache():
        order = rowplan.plan_rows(keys, segment, G, pos)()
        assert torch.equal(order.cpu(), ref_rows.key_order(keys.cpu()))
        with pytest.MonkeyPatch.context() as mp:  # every way these facts are computed (each a host sync)
            for name in ("_facts_of", "_segments", "max_abs_position_tensor"):
                mp.setattr(rowplan, name, lambda *a, name=name: pytest.fail(f"{name}: the plan's fact computed again"))
            got_seg = rows.segment_sum(x, segment, G, order, node=NODE)
            got_sum = rows.row_sum(x, order, node=NODE)
            got_cos, _ = rope.rope_tables(pos, 4, 10000.0, node=NODE)
    _same(got_seg, rows.segment_sum(x, segment, G, order, node=NODE).cpu(), "segment_sum")
    _same(got_sum, rows.row_sum(x, order, node=NODE).cpu(), "row_sum")
    _same(got_cos, ref_rope.rope_tables(pos.cpu(), 4, 10000.0)[0], "rope")
    dup = keys.clone()
    dup[1] = dup[0] = torch.tensor([2, 7])
    for call, match in (
        (lambda: rowplan.plan_rows(dup, segment, G, pos)(), "duplicate active key"),
        (lambda: rowplan.plan_rows(keys, segment, 2, pos)(), r"allowed: \[0, 2\)"),
        (lambda: rowplan.plan_rows(keys, segment[:3], G, pos)(), "segment_R"),
        (lambda: rowplan.plan_rows(keys.int(), segment, G, pos)(), "logical_keys"),
        (lambda: rowplan.plan_rows(keys, segment, G, pos * 3000)(), "allowed below 1e6"),
        (lambda: rowplan.plan_rows(keys[0], segment, G, pos)(), "logical_keys"),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    with index_cache():  # a write between the plan and its read would leave its facts stale: refused
        read = rowplan.plan_rows(keys, segment, G, pos)
        segment[3:] = 1
        with pytest.raises(ValueError, match="written between plan_rows and reading its order"):
            read()


def test_a_plan_decided_beforehand_seeds_the_same_facts_without_reading_the_metadata_again():
    """decide_rows (what a CUDA graph capture is given: h3lab.block.graph) then plan_rows(decided=...) gives
    the order and facts plan_rows gives, computes nothing again, and refuses metadata it was not
    decided from or that was written since."""
    R, G = 41, 5
    x, _, segment = _rows_case(R, seed=92)
    g = torch.Generator().manual_seed(93)
    keys = torch.stack([torch.randint(-1, 4, (R,), generator=g), torch.randperm(R, generator=g)], dim=1)
    pos = torch.randint(-900, 900, (R, 3), generator=g)
    x, keys, segment, pos = x.to(DEV), keys.to(DEV), segment.to(DEV), pos.to(DEV)
    decided = rowplan.decide_rows(keys, segment, G, pos)
    with index_cache():
        fresh = rowplan.plan_rows(keys, segment, G, pos)()
        want = rows.segment_sum(x, segment, G, fresh, node=NODE), rows.row_sum(x, fresh, node=NODE)
    with index_cache(), pytest.MonkeyPatch.context() as mp:
        for name in ("_facts_of", "_segments", "max_abs_position_tensor", "_decide"):
            mp.setattr(rowplan, name, lambda *a, name=name: pytest.fail(f"{name}: computed again"))
        order = rowplan.plan_rows(keys, segment, G, pos, decided=decided)()
        got = rows.segment_sum(x, segment, G, order, node=NODE), rows.row_sum(x, order, node=NODE)
        rope.rope_tables(pos, 4, 10000.0, node=NODE)
    _same(order, fresh.cpu(), "order")
    _same(got[0], want[0].cpu(), "segment_sum")
    _same(got[1], want[1].cpu(), "row_sum")
    for call, match in (
        (lambda: rowplan.plan_rows(keys.clone(), segment, G, pos, decided=decided), "logical_keys is not the tensor"),
        (
            lambda: rowplan.plan_rows(keys, segment, G, pos.clone(), decided=decided),
            r"positions_R3 \(the position ids\) is not",
        ),
        (
            lambda: rowplan.plan_rows(keys, segment, G + 1, pos, decided=decided),
            f"num_segments {G + 1}; allowed: {G}, as",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    segment[0] = (segment[0] + 1) % G
    with pytest.raises(ValueError, match=r"segment_R \(the AdaLN indices\) written after decide_rows"):
        rowplan.plan_rows(keys, segment, G, pos, decided=decided)
    with pytest.raises(ValueError, match="allowed: backend 'triton'"):
        get_backend("torch").plan_rows(keys, segment, G, pos, decided=decided)


def test_a_block_step_with_its_rows_decided_ahead_gives_the_same_bytes():
    """The Triton backend's whole block step (the interpreter here, compiled on a GPU) with its row plan
    decided beforehand, as h3lab.block.graph captures it, equals the step that plans for itself byte for
    byte, and decides nothing again: rows out of key order, padding among them."""
    from h3lab import H3Config, packed_batch, synthetic_block
    from h3lab.block import block_step
    from h3lab.comm import LocalComm
    from h3lab.units import unit_weights

    c = H3Config.tiny()
    b = packed_batch(c, 17, seed=2, padding=3, dtype=BF16 if CUDA else F32)  # the interpreter's attention takes FP32
    b = b.rows(torch.randperm(b.num_rows, generator=torch.Generator().manual_seed(3))).to(DEV)
    uw, be = unit_weights(synthetic_block(c, 0, seed=1).to(DEV)), TritonBackend(DEV, node=NODE)

    def step(decided: rowplan.RowPlan | None) -> dict[str, torch.Tensor]:
        s = block_step(uw, b, LocalComm(), backend=be, decided_rows=decided)  # a backend object: a node on CPU
        flat = {"out": s.out, "dx": s.dx, "dtemb": s.dtemb, **s.dw_replicated}
        return flat | {f"{k}.{u}": t for k, per_unit in s.dw_units.items() for u, t in per_unit.items()}

    want = step(None)
    decided = rowplan.decide_rows(b.logical_keys, b.adaln_indices, 3 * b.num_timesteps, b.position_ids)
    with pytest.MonkeyPatch.context() as mp:  # every host-side fact comes from the plan
        for name in ("_facts_of", "_segments", "max_abs_position_tensor", "_decide"):
            mp.setattr(rowplan, name, lambda *a, name=name: pytest.fail(f"{name}: computed again"))
        got = step(decided)
    assert got.keys() == want.keys()
    for k in want:
        _same(got[k], want[k].cpu(), k)


def test_index_checks_outside_a_block_see_writes_that_keep_the_version():
    """Outside index_cache() nothing is cached: a write through .data (no version bump) is still caught."""
    x = torch.randn(5, 4, device=DEV)
    order = torch.tensor([4, 0, 2], device=DEV)
    rows.row_sum(x, order, node=NODE)
    order.data[0] = 7
    with pytest.raises(ValueError, match=r"order: values in \[0, 7\]; allowed: \[0, 5\)"):
        rows.row_sum(x, order, node=NODE)


# ---- the backend --------------------------------------------------------------------------------


def test_backend_implements_the_protocol_and_records_its_configs():
    be = TritonBackend(DEV, node=NODE)
    methods = {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    assert methods and not {n for n in methods if not callable(getattr(be, n, None))}
    assert be.name == "triton" and be.node == "sm90"
    record = be.describe()
    assert record["node"] == "sm90" and {"norm", "elementwise", "rows"} <= set(record["kernels"])
    x, order, _ = (t.to(DEV) for t in _rows_case(37, seed=50))
    _same(be.row_sum(x, order), rows.row_sum(x, order, node=NODE).cpu(), "backend row_sum")
    _same(be.round(x[:, 0], BF16), round_to(x[:, 0].cpu(), BF16), "backend round")


def test_backend_methods_take_the_protocols_arguments_in_order():
    """Most methods hand their arguments on, in order, to a kernel module's launcher with the backend's
    node (h3lab.triton.backend._on_node): each takes the protocol's parameters (names up to their shape
    suffix, kinds, defaults) in the protocol's order."""

    def params(fn):
        ps = inspect.signature(fn).parameters.values()
        return [(re.sub(r"_[A-Z0-9]+$", "", p.name), p.kind, p.default) for p in ps]

    be = TritonBackend(DEV, node=NODE)
    methods = [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")]
    assert len(methods) > 20
    for name in methods:
        assert params(getattr(be, name)) == params(getattr(Backend, name))[1:], name  # [1:]: self


def test_backend_needs_cuda_or_the_interpreter():
    if CUDA:
        assert isinstance(get_backend("triton", DEV), TritonBackend)
        with pytest.raises(ValueError, match="CUDA"):
            TritonBackend("cpu", node="sm90")  # compiled kernels cannot take CPU tensors
    else:
        with pytest.raises(ValueError, match="explicit node"):
            TritonBackend("cpu")
        with pytest.raises(ValueError, match="CUDA"):
            get_backend("triton", "cpu")


# ---- GPU: bf16 at the block's real widths (D 5376, 56 heads x 128, 96 rotated, F/8 1792) -----------

R_GPU = 264  # odd batch: 3 timesteps x 88 rows, not a multiple of any tile


@gpu
@pytest.mark.gpu
def test_gpu_row_local_ops_bf16_real_widths_equal_reference():
    R, D, H, Dh, F8 = R_GPU, 5376, 56, 128, 1792
    x, dm = (_randn(R, D, seed=s).to(DEV, BF16) for s in (60, 61))
    w = (1 + _randn(D, seed=62, scale=0.1)).to(DEV, BF16)
    shift, scale, gate = _table_rows(R, D, seed=63, dtype=BF16)
    assert gate.stride(0) == 6 * D
    pos = torch.randint(0, 64, (R, 3), generator=torch.Generator().manual_seed(64))
    cos, sin = (t.to(DEV) for t in ref_rope.rope_tables(pos, 16, 10000.0))  # C = 96
    q, dq = _randn(R, H, Dh, seed=65).to(DEV, BF16), _randn(R, H, Dh, seed=66).to(DEV)  # dq: attention's FP32
    wq = (1 + _randn(Dh, seed=67, scale=0.1)).to(DEV, BF16)
    h, g, da = (_randn(R, F8, seed=s, scale=3.0).to(DEV, BF16) for s in (68, 69, 70))
    out = norm.rms_modulate_fwd(x, w, scale, shift, EPS, BF16)
    got_dq, got_dw = norm.qk_norm_rope_bwd(dq, q, wq, cos, sin, EPS, BF16)
    with _ieee_sqrt():
        _same(out, round_to(ref_norm.rms_modulate_fwd(*_cpu(x, w, scale, shift), EPS), BF16), "rms fwd")
        for name, got, want in zip(
            ("dx", "dw", "dscale", "dshift"),
            norm.rms_modulate_bwd(dm, x, w, scale, EPS),
            ref_norm.rms_modulate_bwd(*_cpu(dm, x, w, scale), EPS),
            strict=True,
        ):
            _same(got, want, f"rms bwd {name}")
        _same(
            norm.qk_norm_rope_fwd(q, wq, cos, sin, EPS, BF16),
            round_to(ref_norm.qk_norm_rope_fwd(*_cpu(q, wq, cos, sin), EPS), BF16),
            "qk fwd",
        )
        want_dq, want_dw = ref_norm.qk_norm_rope_bwd(*_cpu(dq, q, wq, cos, sin), EPS)
        _same(got_dq, round_to(want_dq, BF16), "qk bwd dq")
        _same(got_dw, want_dw, "qk bwd dw")
    _same(elementwise.swiglu_fwd(h, g, BF16), round_to(ref_elementwise.swiglu_fwd(*_cpu(h, g)), BF16), "swiglu fwd")
    for name, got, want in zip(
        ("dh", "dg"), elementwise.swiglu_bwd(da, h, g, BF16), ref_elementwise.swiglu_bwd(*_cpu(da, h, g)), strict=True
    ):
        _same(got, round_to(want, BF16), f"swiglu bwd {name}")
    _same(
        elementwise.gated_residual(x, gate, dm, BF16),
        round_to(ref_elementwise.gated_residual(*_cpu(x, gate, dm)), BF16),
        "residual",
    )
    # rows that share a call never change each other's bits, at the real widths too
    sub = norm.rms_modulate_fwd(x[100:], w, scale[100:], shift[100:], EPS, BF16)
    _same(sub, out[100:].cpu(), "rms sub-batch")
    sub = norm.qk_norm_rope_bwd(dq[7:8], q[7:8], wq, cos[7:8], sin[7:8], EPS, BF16)[0]
    _same(sub, got_dq[7:8].cpu(), "qk sub-batch")


@gpu
@pytest.mark.gpu
def test_gpu_row_reductions_real_widths():
    R, D, H, Dh, T = R_GPU, 5376, 56, 128, 2
    g = torch.Generator().manual_seed(80)
    order = torch.randperm(R, generator=g)[: R - 17]  # 17 padding rows
    dw_rows = _randn(R, D, seed=81)
    dwq = _randn(R, H, Dh, seed=82)
    d_table = _randn(R, 6, D, seed=83)
    seg = torch.randint(0, 3 * T, (R,), generator=g)
    od = order.to(DEV)
    _same(rows.row_sum(dw_rows.to(DEV), od), ref_rows.row_sum(dw_rows, order), "norm weight grad")
    _same(rows.row_sum(dwq.to(DEV), od), ref_rows.row_sum(dwq, order), "q-norm weight grad")
    got = rows.segment_sum(d_table.to(DEV), seg.to(DEV), 3 * T, od)
    _same(got, ref_rows.segment_sum(d_table, seg, 3 * T, order), "AdaLN table grad")
    tables = [d_table[:, i].contiguous() for i in range(3)]  # the block's six-set launch: norm1, q/k norms, table
    sums, segs = rows.chain_sums(_dev(dw_rows, dwq, dwq * 2), _dev(*tables), seg.to(DEV), 3 * T, od)
    for got, t, what in zip(sums, (dw_rows, dwq, dwq * 2), ("norm1", "norm_q", "norm_k"), strict=True):
        _same(got, ref_rows.row_sum(t, order), f"{what} weight grad among six sets")
    for i, (got, t) in enumerate(zip(segs, tables, strict=True)):
        _same(got, ref_rows.segment_sum(t, seg, 3 * T, order), f"AdaLN table column {i} among six sets")
    a, b = _randn(R, 1792, seed=84).to(DEV, BF16), _randn(R, D, seed=85).to(DEV, BF16)
    got = rows.row_mm(a, b, od)
    torch.testing.assert_close(got.cpu(), ref_rows.row_mm(*_cpu(a, b), order), rtol=1e-4, atol=1e-3)  # tensor cores
    perm = torch.randperm(R, generator=g).to(DEV)
    _same(rows.row_mm(a[perm], b[perm], torch.argsort(perm)[od]), got.cpu(), "row_mm, rows permuted")


def _dev(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in ts]


def test_index_checks_work_on_inference_tensors():
    """Tensors made under torch.inference_mode keep no version counter: checked every time, never cached."""
    x = torch.randn(5, 4, device=DEV)
    with torch.inference_mode():
        order = torch.tensor([4, 0, 2], device=DEV)
        got = rows.row_sum(x, order, node=NODE)
        with pytest.raises(ValueError, match=r"allowed: \[0, 3\)"):
            rows.row_sum(x[:3], order, node=NODE)
    _same(got, rows.row_sum(x, torch.tensor([4, 0, 2], device=DEV), node=NODE).cpu(), "inference")
