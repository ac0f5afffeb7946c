"""Fixed-order GEMMs (h3lab.triton.gemm.mm, h3lab.triton.unit_gemm.unit_mm): bitwise invariance to
which rows and columns share a call, to the TP grouping of units and to repeats; agreement with
float64 and with the torch chains.

Without CUDA the kernels run under the Triton interpreter (set below, before triton is imported) in
FP32 with IEEE products: the interpreter's bf16 is numerically wrong (its fp32 -> bf16 cast truncates).
With CUDA the `gpu` tests run the compiled bf16 kernels at real H3 shapes; run them in their own
process if another test module forces TRITON_INTERPRET=1:  pytest -m gpu tests/test_kernels_gemm.py

Why the interpreter's bits are the same on every CPU: its tl.dot is tests/conftest.py's chain_dot,
one FP32 chain per element continued from the accumulator, k ascending, numpy elementwise multiply
and add (no BLAS). The interpreter's own tl.dot is np.matmul, whose order the host's BLAS picks per
CPU (OpenBLAS' Haswell and Zen kernels: by a row's place in the tile), so the bitwise tests failed
there. With the chain an output's bits follow from its operands and the order the kernel feeds k
in, which is what these tests check; and an FP32 mm is chain_mm, a unit_mm TorchBackend.unit_reduce,
bit for bit, which pins the kernels' k order, masks and unit partials, not only their invariances.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the GEMM kernels are Triton kernels)")

from h3lab.backend import TorchBackend
from h3lab.ops.chain import chain_mm
from h3lab.ops.fixed import round_to, unit_tree
from h3lab.triton import configs, gemm, gemm_host, unit_gemm
from tests.conftest import assert_bitwise, gpu_kernels

# tl.dot under the interpreter: our FP32 chain, not the host BLAS (tests/conftest.py chain_dot)
pytestmark = pytest.mark.usefixtures("chain_dot")

interp = pytest.mark.skipif(
    not configs.interpreting(), reason="interpreter tests: run with TRITON_INTERPRET=1 (set by default without CUDA)"
)


gpu = gpu_kernels(__file__)


NODE = "sm90"  # interpreter runs name the node type; its pinned tile geometry is what they exercise
F32, BF16 = torch.float32, torch.bfloat16
# FP32 agreement with float64 (interpreter): any order of K rounded FP32 products and adds is within
# gamma_{K+1} * sum|a||b| ~ (K+1) * 2^-24 * sum|a||b| of the exact sum; we allow 2x that, per element.
# Norm-relative errors of the K-ascending chain (the interpreter's, chain_dot) at K <= 3456 are
# 1e-7..5e-7, so 2e-6 leaves ~4x margin.
REL_FP32 = 2e-6


def _tc(kernel: str) -> dict:
    """The pinned tensor-core configuration (bf16 tiles, TMA) of `kernel`, run here on fp32 operands."""
    return gemm_host.kernel_config(kernel, NODE, ieee=False)


def _randn(*shape: int, seed: int, device: str = "cpu", dtype: torch.dtype = F32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _pieces(M: int, kps: tuple[int, ...], N: int, units: int, seed: int, device="cpu", dtype=F32, w_major=True):
    """[(a [M, U*Kp], b [U*Kp, N])]; b is a weight's transposed view (forward) or the weight (dX)."""
    out = []
    for i, kp in enumerate(kps):
        a = _randn(M, units * kp, seed=seed + 2 * i, device=device, dtype=dtype)
        w = _randn(N, units * kp, seed=seed + 2 * i + 1, device=device, dtype=dtype)
        out.append((a, w.t() if w_major else w.t().contiguous()))
    return out


def _slice_units(pieces, lo: int, hi: int, units: int):
    """The pieces a TP rank holding units [lo, hi) of `units` sees."""
    out = []
    for a, b in pieces:
        kp = a.shape[1] // units
        out.append((a[:, lo * kp : hi * kp], b[lo * kp : hi * kp]))
    return out


def _assert_exact_within(out: torch.Tensor, pieces, slack: float, rel: float, what: str) -> None:
    """|out - exact| <= slack * (K+1) * 2^-24 * sum|a||b| per element, and a norm-relative bound."""
    exact = sum(a.double() @ b.double() for a, b in pieces)
    mag = sum(a.double().abs() @ b.double().abs() for a, b in pieces)
    k = sum(a.shape[1] for a, _ in pieces)
    err = (out.double() - exact).abs()
    assert bool((err <= slack * (k + 1) * 2.0**-24 * mag).all()), f"{what}: max err {float(err.max()):.3g}"
    assert float(err.norm() / exact.norm()) < rel, f"{what}: relative error {float(err.norm() / exact.norm()):.3g}"


def _tp_groupings(pieces, units: int, run) -> dict[int, torch.Tensor]:
    """For TP sizes 1, 2, 4, 8 (as far as `units` allows): each rank's subtree, then the tree over ranks."""
    out = {}
    for tp in (1, 2, 4, 8):
        if tp > units:
            break
        per = units // tp
        roots = [run(_slice_units(pieces, r * per, (r + 1) * per, units), per) for r in range(tp)]
        out[tp] = unit_tree(roots)
    return out


# ---- interpreter: mm ---------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("which", ["pinned_fp32", "tensor_core"])
def test_mm_rows_and_columns_bitwise(which):
    cfg = None if which == "pinned_fp32" else _tc("gemm")
    M, K, N = 37, 100, 300  # K tail of 36, two column tiles at 256, partial row tiles
    a = _randn(M, K, seed=1)
    w = _randn(N, K, seed=2)
    for b, layout in ((w.t(), "W.T"), (w.t().contiguous(), "[K, N]")):
        full = gemm.mm(a, b, node=NODE, config=cfg)
        assert_bitwise(full, chain_mm(a, b), f"mm {layout} is the chain over K")
        _assert_exact_within(full, [(a, b)], 2.0, REL_FP32, f"mm {layout}")
        for lo, hi in ((0, 1), (5, 8), (20, 37), (3, 20)):
            assert_bitwise(gemm.mm(a[lo:hi], b, node=NODE, config=cfg), full[lo:hi], f"rows {lo}:{hi} {layout}")
        for lo, hi in ((0, 1), (3, 11), (200, 300), (5, 261)):  # 3: misaligned N-major start -> pointer path
            assert_bitwise(gemm.mm(a, b[:, lo:hi], node=NODE, config=cfg), full[:, lo:hi], f"cols {lo}:{hi} {layout}")
        assert_bitwise(gemm.mm(a, b, node=NODE, config=cfg), full, "repeat")


@interp
def test_mm_paths_and_layouts_agree():
    """TMA and pointer loads, row- and column-major a, both b layouts: the same chunks, the same bits."""
    M, K, N = 17, 130, 70
    a = _randn(M, K, seed=3)
    w = _randn(N, K, seed=4)
    ref = gemm.mm(a, w.t(), node=NODE, config=_tc("gemm"))
    assert_bitwise(ref, chain_mm(a, w.t()), "the chain over K")
    for tma in (True, False):
        cfg = _tc("gemm") | {"TMA": tma}
        for a_ in (a, a.t().contiguous().t()):
            for b_ in (w.t(), w.t().contiguous()):
                assert_bitwise(gemm.mm(a_, b_, node=NODE, config=cfg), ref, f"tma={tma} {a_.stride()} {b_.stride()}")


@interp
def test_mm_bf16_output_rows_bitwise():
    a, w = _randn(17, 64, seed=5), _randn(40, 64, seed=6)
    full = gemm.mm(a, w.t(), BF16, node=NODE)
    assert full.dtype == BF16
    assert_bitwise(gemm.mm(a[3:9], w.t(), BF16, node=NODE), full[3:9], "bf16 rows")


@interp
def test_mm_row_tail_rides_on_row_tiles():
    """TAIL_M/TAIL_N: the last M % BLOCK_M rows computed in slices by the full row tiles give the bits of
    the plain tiling, for rows and columns sliced any way: tails as tall as the row tiles (BLOCK_M = 16)
    and shorter (16 rows beside 32-row tiles, as on the GPU: 16 beside 64)."""
    plain16 = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2, "TMA": True}
    K, N = 100, 150  # K tail of 4; a partial column tile, whose second tail slice is past N
    w = _randn(N, K, seed=40)
    cases = [(plain16, M, rides) for M, rides in ((37, True), (48, False), (1, False), (133, True), (25, False))]
    cases += [(plain16 | {"BLOCK_M": 32}, M, rides) for M, rides in ((73, True), (47, False))]  # 25, 47: 1 row tile
    tail = {"TAIL_M": 16, "TAIL_N": 32}
    for plain, M, rides in cases:
        cfg = plain | tail
        a = _randn(M, K, seed=41 + M)
        rode = gemm_host.tail_operands(a, w.t(), 1, 1, cfg, gemm_host.programs("cpu"), BF16)[2] is not None
        assert rode == rides, f"M={M}: the tail rides: {rode}, expected {rides}"
        assert gemm_host.tail_operands(a, w.t(), 1, 1, cfg, gemm_host.programs("cpu"), F32)[2] is None, (
            "fp32 out: no tail"
        )
        ref = gemm.mm(a, w.t(), BF16, node=NODE, config=plain)  # the interpreter's bf16 cast truncates: same in both
        got = gemm.mm(a, w.t(), BF16, node=NODE, config=cfg)
        assert_bitwise(got, ref, f"M={M} tail")
        cols = gemm.mm(a, w.t()[:, 30:140], BF16, node=NODE, config=cfg)
        assert_bitwise(cols, ref[:, 30:140], f"M={M} columns 30:140")
        rows = gemm.mm(a[M // 3 :], w.t(), BF16, node=NODE, config=cfg)
        assert_bitwise(rows, ref[M // 3 :], f"M={M} rows from {M // 3}")
    with pytest.raises(ValueError, match=r"TAIL_M=24, TAIL_N=32 .* allowed: both set, powers of two"):
        gemm.mm(_randn(37, K, seed=1), w.t(), node=NODE, config=plain16 | tail | {"TAIL_M": 24})
    with pytest.raises(ValueError, match=r"TAIL_M=16, TAIL_N=None"):
        gemm.mm(_randn(0, K, seed=1), w.t(), node=NODE, config=plain16 | {"TAIL_M": 16})  # refused before M = 0 returns
    with pytest.raises(ValueError, match=r"FLATTEN=True, WARP_SPECIALIZE=None; allowed: both false"):
        gemm.mm(_randn(37, K, seed=1), w.t(), node=NODE, config=plain16 | tail | {"FLATTEN": True})


@interp
def test_mm_empty_and_k0():
    a, w = _randn(3, 0, seed=7), _randn(5, 0, seed=8)
    assert_bitwise(gemm.mm(a, w.t(), node=NODE), torch.zeros(3, 5), "K = 0 is the empty chain")
    assert gemm.mm(_randn(0, 4, seed=9), _randn(4, 6, seed=10), node=NODE).shape == (0, 6)


@interp
def test_mm_rejects_bad_inputs(tmp_path, monkeypatch):
    a, b = _randn(4, 8, seed=11), _randn(8, 5, seed=12)
    cases = [
        ((a[0], b), "2-D"),
        ((a.to(torch.float16), b), "allowed: \\[torch.bfloat16, torch.float32\\]"),
        ((a.to(torch.int32), b), "dtype"),
        ((a, b[:7]), "a.shape\\[1\\] == b.shape\\[0\\]"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            gemm.mm(*args, node=NODE)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm.mm(a, b, torch.float16, node=NODE)
    with pytest.raises(ValueError, match="no pinned configuration file"):
        gemm.mm(a, b, node="sm70")
    with pytest.raises(ValueError, match="missing \\['BLOCK_N'"):
        gemm.mm(a, b, node=NODE, config={k: v for k, v in _tc("gemm").items() if k != "BLOCK_N"})
    with pytest.raises(ValueError, match="unknown \\['NUM_STAGES'\\]"):
        unit_gemm.unit_mm([(a, b)], 1, node=NODE, config=_tc("unit_gemm") | {"NUM_STAGES": 3})
    with pytest.raises(ValueError, match="unknown \\['IMPL'\\]"):  # a unit_gemm key: mm has one implementation
        gemm.mm(a, b, node=NODE, config=_tc("gemm") | {"IMPL": "gluon"})
    (tmp_path / "sm90.json").write_text('{"kernels": {"norm": {}}}')
    monkeypatch.setattr(configs, "KERNELS_DIR", tmp_path)
    configs._load.cache_clear()
    try:
        with pytest.raises(ValueError, match="pins no configuration for kernel 'gemm'"):
            gemm.mm(a, b, node=NODE)
        with pytest.raises(ValueError, match="pins no configuration for kernel 'unit_gemm'"):
            unit_gemm.unit_mm([(a, b)], 1, node=NODE)
    finally:
        configs._load.cache_clear()


# ---- interpreter: unit_mm ----------------------------------------------------------------------


@interp
@pytest.mark.parametrize(
    ("which", "kps", "M", "N"),
    [
        ("pinned_fp32", (432,), 3, 40),  # d temb form: 18D/8 units, few rows
        ("pinned_fp32", (64, 64), 17, 70),  # hidden, gate dX
        ("tensor_core", (32,), 37, 150),  # to_out: Kp < BLOCK_K, a partial chunk per unit
        ("tensor_core", (64, 64, 64), 17, 70),  # q, k, v dX: Kp = BLOCK_K -> TMA
        ("scratch_level0", (32, 32), 1, 70),  # level-0 sibling in scratch too
        ("scratch_pointers", (32,), 3, 70),  # scratch through pointer loads/stores instead of TMA
    ],
)
def test_unit_mm_tp_groupings_rows_columns_bitwise(which, kps, M, N):
    cfg = {
        "pinned_fp32": None,
        "tensor_core": _tc("unit_gemm"),
        "scratch_level0": _tc("unit_gemm") | {"PENDING_IN_REGS": False},
        "scratch_pointers": _tc("unit_gemm") | {"SCRATCH_TMA": False},
    }[which]
    pieces = _pieces(M, kps, N, 8, seed=20, w_major=len(kps) == 1)
    run = lambda p, u: unit_gemm.unit_mm(p, u, node=NODE, config=cfg)  # noqa: E731
    roots = _tp_groupings(pieces, 8, run)
    full = roots[1]
    assert_bitwise(full, TorchBackend().unit_reduce(pieces, 8), f"unit_mm {kps} is the torch chains' tree")
    _assert_exact_within(full, pieces, 2.0, REL_FP32, f"unit_mm {kps}")
    for tp, root in roots.items():
        assert_bitwise(root, full, f"TP{tp} grouping {kps}")
    if M > 2:
        assert_bitwise(run([(a[1:3], b) for a, b in pieces], 8), full[1:3], "rows 1:3")
    assert_bitwise(run([(a, b[:, 5 : N - 3]) for a, b in pieces], 8), full[:, 5 : N - 3], "cols")


@interp
@pytest.mark.parametrize("which", ["pinned_fp32", "tensor_core"])
def test_unit_mm_is_the_tree_of_unit_partials(which):
    """One piece: partial i == mm(a[:, unit i], b[unit i]) with the same tiles; three pieces whose Kp
    is a multiple of BLOCK_K: == mm over the unit's blocks laid side by side (the same chunks)."""
    cfg_u = None if which == "pinned_fp32" else _tc("unit_gemm")
    cfg_m = None if which == "pinned_fp32" else _tc("gemm") | {k: _tc("unit_gemm")[k] for k in ("BLOCK_M", "BLOCK_N")}
    for kps in ((32,), (64, 64, 64)):
        pieces = _pieces(5, kps, 48, 8, seed=30)
        got = unit_gemm.unit_mm(pieces, 8, node=NODE, config=cfg_u)
        parts = []
        for u in range(8):
            blocks = _slice_units(pieces, u, u + 1, 8)
            a_u = torch.cat([a for a, _ in blocks], dim=1)
            b_u = torch.cat([b for _, b in blocks], dim=0)
            parts.append(gemm.mm(a_u, b_u, node=NODE, config=cfg_m))
        assert_bitwise(got, unit_tree(parts), f"tree of mm partials {kps}")


@interp
def test_unit_mm_fp32_activations_bf16_weights():
    """d temb: a FP32 [T, 8*Kp], b bf16 -> IEEE FP32 products of the exactly widened weight."""
    a = _randn(3, 8 * 432, seed=40)
    b = _randn(8 * 432, 24, seed=41).to(BF16)
    got = unit_gemm.unit_mm([(a, b)], 8, node=NODE)
    _assert_exact_within(got, [(a, b.float())], 2.0, REL_FP32, "fp32 x bf16")
    assert_bitwise(got, TorchBackend().unit_reduce([(a, b)], 8), "the torch chains' tree")


@interp
def test_unit_mm_rejects_bad_inputs():
    a, b = _randn(4, 16, seed=50), _randn(16, 5, seed=51)
    cases = [
        (([(a, b)], 3), "num_units=3; allowed: \\[1, 2, 4, 8\\]"),
        (([], 8), "0 pieces"),
        (([(a, b)] * 4, 8), "4 pieces"),
        (([(a[:, :12], b[:12])], 8), "multiple of num_units=8"),
        (([(a, b), (a[:2], b)], 8), "every a with M=4 rows"),
        (([(a, b), (a, b[:, :3])], 8), "every b with N=5 columns"),
        (([(a, b.to(torch.float16))], 8), "dtype"),
        (([(a, b[:8])], 8), "a.shape\\[1\\] == b.shape\\[0\\]"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            unit_gemm.unit_mm(*args, node=NODE)


@interp
def test_bench_runs_in_the_interpreter(monkeypatch):
    """h3lab.bench.gemm_bench end to end on toy shapes (CPU, FP32): every contract check it makes holds,
    except the bf16 rounding ones (the interpreter's fp32 -> bf16 cast truncates)."""
    from h3lab.bench import gemm_bench as gb

    toy = {
        "DEV": "cpu",
        "CHECK_ROWS": 37,
        "CHECK_K": 100,
        "CHECK_N": {"WT": 70, "KN": 68},
        "SMALL": 20,
        "DW_ROWS": 40,
        "ROW_SLICES": ((0, 1), (7, 3), (10, 17), (3, 30)),
        "COL_SLICES": ((0, 1), (3, 30), (16, 60)),
        "TINY_UNITS": ((32,),),
        "MM_SHAPES": {"q": (100, 70, "WT"), "dx": (64, 72, "KN"), "dw": (0, 72, "KN")},
        "UNIT_SHAPES": {"to_out": ((32,), 48, "WT"), "dx": ((64, 64), 40, "KN")},
        "_randn": lambda *shape, seed, dtype=None: _randn(*shape, seed=seed),
        "node_of": lambda device: NODE,
        "_ms": lambda fn, big: (fn(), 1.0)[1],
    }
    for name, value in toy.items():
        monkeypatch.setattr(gb, name, value)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    rec = gb.bench({"only-the-pinned-ones"}, [5])
    summary = gb.summarize(rec)
    for kind in ("mm", "unit"):
        assert list(rec[kind]) == ["pinned"] and "error" not in rec[kind]["pinned"], rec[kind]
        failed = {k for k, ok in rec[kind]["pinned"]["contract"]["checks"].items() if not ok}
        assert failed <= {"bf16_one_rounding_WT", "bf16_one_rounding_KN"}, failed
        assert len(rec[kind]["pinned"]["ratio"]) == len(toy["MM_SHAPES" if kind == "mm" else "UNIT_SHAPES"])
    assert summary["best"]["unit"]["name"] == "pinned"


# ---- GPU: bf16 at real H3 shapes ---------------------------------------------------------------

# bf16 x bf16 products are exact in FP32; the tensor cores and chain_mm differ only in the order (and,
# inside one MMA, the rounding mode) of their FP32 adds. Per element both are within K * 2^-23 *
# sum|a||b| of the exact sum (truncating adds: twice round-to-nearest's 2^-24), so they differ by at
# most twice that; we allow 4x (K + 64) * 2^-23 to cover the tree's 3 extra adds. Norm-relative to
# float64 the expected error is ~sqrt(K) * 2^-24 ~ 1e-6 at K = 21504: 1e-5 is the bound.
REL_GPU = 1e-5
REAL = {  # name: (kps per piece, N, weights as W.T (forward) or W (dX)) with U = 8
    "to_out": ((896,), 5376, True),
    "ff.net.2": ((1792,), 5376, True),
    "qkv.dx": ((896, 896, 896), 5376, False),
    "ff.net.0.dx": ((1792, 1792), 5376, False),
}


def _assert_close_to_chain(out: torch.Tensor, ref: torch.Tensor, pieces, what: str) -> None:
    mag = sum(a.double().abs() @ b.double().abs() for a, b in pieces)
    k = sum(a.shape[1] for a, _ in pieces)
    err = (out.double() - ref.double()).abs()
    assert bool((err <= 4 * (k + 64) * 2.0**-23 * mag).all()), f"{what}: max |triton - chain| {float(err.max()):.3g}"
    _assert_exact_within(out, pieces, 4.0 * (k + 64) / (k + 1), REL_GPU, what)


@gpu
def test_gpu_mm_rows_columns_repeat_bitwise():
    dev = "cuda"
    a = _randn(4111, 5376, seed=60, device=dev, dtype=BF16)  # 4111 is prime
    w_q = _randn(7168, 5376, seed=61, device=dev, dtype=BF16)  # to_q: b = W.T (forward)
    w_kn = _randn(5376, 4100, seed=62, device=dev, dtype=BF16)  # [K, N] rows (the dX form)
    for b, layout in ((w_q.t(), "W.T"), (w_kn, "[K, N]")):
        full = gemm.mm(a, b)
        for lo, m in ((0, 1), (7, 3), (100, 17), (1000, 264), (5, 4099)):
            assert_bitwise(gemm.mm(a[lo : lo + m], b), full[lo : lo + m], f"rows {lo}+{m} {layout}")
        for lo, hi in ((0, 1), (3, 300), (256, 1000), (1, 4095)):  # [K, N] from column 3: the pointer path
            assert_bitwise(gemm.mm(a, b[:, lo:hi]), full[:, lo:hi], f"cols {lo}:{hi} {layout}")
        for _ in range(3):
            assert_bitwise(gemm.mm(a, b), full, f"repeat {layout}")
        assert_bitwise(gemm.mm(a, b, BF16), round_to(full, BF16), f"one rounding to bf16 {layout}")


@gpu
def test_gpu_mm_row_tail_bitwise():
    """The pinned row tail (the last M % 64 <= 16 rows in 64-column slices on the 64x256 row tiles, a swapped
    wgmma beside the main one) gives the bits of the same rows inside a 4111-row call (128x256 tiles)."""
    dev = "cuda"
    a = _randn(4111, 5376, seed=63, device=dev, dtype=BF16)
    w = _randn(7168, 5376, seed=64, device=dev, dtype=BF16)
    full = gemm.mm(a, w.t(), BF16)
    pinned = gemm_host.kernel_config("gemm", configs.node_of(dev), ieee=False, rows=264)
    sms = gemm_host.programs(dev)
    # 273 rows: a tail of 17; N = 5376 or 4900: 105 or 100 plain tiles, one round of 132 SMs
    cases = (
        (0, 264, 7168, True),
        (3, 263, 7168, True),
        (700, 272, 7168, True),
        (9, 273, 7168, False),
        (50, 520, 7168, True),
        (11, 264, 5376, False),
        (12, 264, 4900, False),
    )
    for lo, m, n, rides in cases:
        part, b = a[lo : lo + m], w.t()[:, :n]
        rode = gemm_host.tail_operands(part, b, 1, 1, pinned, sms, BF16)[2] is not None
        assert rode == rides, f"rows {lo}+{m}, N={n}: the tail rides: {rode}, expected {rides}"
        assert_bitwise(gemm.mm(part, b, BF16), full[lo : lo + m, :n], f"rows {lo}+{m}, N={n} (tail rides: {rides})")
        assert_bitwise(gemm.mm(part, b[:, 100:], BF16), full[lo : lo + m, 100:n], f"rows {lo}+{m} columns from 100")


@gpu
def test_gpu_mm_paths_agree_and_match_chain():
    dev = "cuda"
    a = _randn(264, 5376, seed=62, device=dev, dtype=BF16)
    w = _randn(1000, 5376, seed=63, device=dev, dtype=BF16)
    pinned = gemm_host.kernel_config("gemm", configs.node_of(dev), ieee=False)
    ref = gemm.mm(a, w.t(), config=pinned)
    for tma in (True, False):
        for a_ in (a, a.t().contiguous().t()):
            for b_ in (w.t(), w.t().contiguous()):
                got = gemm.mm(a_, b_, config=pinned | {"TMA": tma})
                assert_bitwise(got, ref, f"tma={tma} a{a_.stride()} b{b_.stride()}")
    _assert_close_to_chain(ref, chain_mm(a, w.t()), [(a, w.t())], "mm vs chain_mm")


@gpu
@pytest.mark.parametrize("name", list(REAL))
def test_gpu_unit_mm_real_shapes(name):
    kps, N, w_major = REAL[name]
    pieces = _pieces(264, kps, N, 8, seed=70, device="cuda", dtype=BF16, w_major=w_major)
    roots = _tp_groupings(pieces, 8, lambda p, u: unit_gemm.unit_mm(p, u))
    full = roots[1]
    for tp, root in roots.items():
        assert_bitwise(root, full, f"{name}: TP{tp} grouping")
    assert_bitwise(unit_gemm.unit_mm([(a[17:20], b) for a, b in pieces], 8), full[17:20], f"{name}: rows")
    assert_bitwise(unit_gemm.unit_mm([(a, b[:, 3:301]) for a, b in pieces], 8), full[:, 3:301], f"{name}: cols")
    for _ in range(3):
        assert_bitwise(unit_gemm.unit_mm(pieces, 8), full, f"{name}: repeat")
    _assert_close_to_chain(full, TorchBackend().unit_reduce(pieces, 8), pieces, f"{name} vs unit_reduce")


@gpu
def test_gpu_unit_mm_is_the_tree_of_mm_partials():
    """Same tiles in both kernels -> unit partial i == mm(a[:, unit i], b[unit i]) bit for bit."""
    pieces = _pieces(264, (896,), 5376, 8, seed=80, device="cuda", dtype=BF16)
    (a, b) = pieces[0]
    node = configs.node_of("cuda")
    unit_cfg = gemm_host.kernel_config("unit_gemm", node, ieee=False)
    tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    cfg = gemm_host.kernel_config("gemm", node, ieee=False) | {k: unit_cfg[k] for k in tiles}  # mm with the unit tiles
    parts = [gemm.mm(a[:, u * 896 : (u + 1) * 896], b[u * 896 : (u + 1) * 896], config=cfg) for u in range(8)]
    assert_bitwise(unit_gemm.unit_mm(pieces, 8), unit_tree(parts), "tree of mm partials")


@gpu
def test_gpu_unit_mm_scratch_modes_agree():
    """Where the Triton kernel's pending siblings live (registers, TMA scratch, pointer scratch) moves no
    bit (against the pinned kernel, which is the Gluon one on sm90: the same bits)."""
    pieces = _pieces(264, (896, 896, 896), 5376, 8, seed=85, device="cuda", dtype=BF16, w_major=False)
    ref = unit_gemm.unit_mm(pieces, 8)
    pinned = gemm_host.kernel_config("unit_gemm", configs.node_of("cuda"), ieee=False) | {"IMPL": "triton"}
    # a TMA store's 64 KiB buffer beside the pinned 4 stages (128 KiB) and the TMA scratch (64 KiB)
    # needs 256 KiB of shared memory, past the H200's 227 KiB: that variant runs 2 stages, which
    # moves no bit either (the K order is the chunk order, whatever the pipeline depth)
    store = {"TMA_STORE": not pinned.get("TMA_STORE"), "num_stages": 2}
    for over in ({"PENDING_IN_REGS": False}, {"SCRATCH_TMA": False}, {"num_stages": 2}, store):
        assert_bitwise(unit_gemm.unit_mm(pieces, 8, config=pinned | over), ref, f"scratch {over}")


@gpu
@pytest.mark.parametrize("kps", [(32,), (64, 64), (432,), (32, 32, 32)])
def test_gpu_unit_mm_tiny_widths(kps):
    pieces = _pieces(37, kps, 192, 8, seed=90, device="cuda", dtype=BF16, w_major=len(kps) == 1)
    roots = _tp_groupings(pieces, 8, lambda p, u: unit_gemm.unit_mm(p, u))
    for tp, root in roots.items():
        assert_bitwise(root, roots[1], f"TP{tp} grouping {kps}")
    _assert_close_to_chain(roots[1], TorchBackend().unit_reduce(pieces, 8), pieces, f"tiny {kps}")


@gpu
def test_gpu_unit_mm_d_temb():
    """FP32 d table columns [T, 18D] against bf16 adaln weights: IEEE products, TP groupings bitwise."""
    a = _randn(3, 8 * 12096, seed=95, device="cuda")
    b = _randn(8 * 12096, 2688, seed=96, device="cuda", dtype=BF16)
    roots = _tp_groupings([(a, b)], 8, lambda p, u: unit_gemm.unit_mm(p, u))
    for tp, root in roots.items():
        assert_bitwise(root, roots[1], f"d temb TP{tp}")
    assert_bitwise(unit_gemm.unit_mm([(a[1:2], b)], 8), roots[1][1:2], "d temb one row")
    _assert_close_to_chain(roots[1], TorchBackend().unit_reduce([(a, b)], 8), [(a, b.float())], "d temb")


def test_unit_mm_gluon_supports_says_why_not():
    """Which calls the Gluon kernel takes (host logic, no GPU): the rest run the Triton kernel."""
    from h3lab.triton import unit_gemm_sm90

    a = _randn(5, 8 * 64, seed=1, dtype=BF16)
    w = _randn(16, 8 * 64, seed=2, dtype=BF16)
    assert unit_gemm_sm90.supports([(a, w.t())], 8) is None  # forward: b = W.T
    assert unit_gemm_sm90.supports([(a, w.t().contiguous())] * 3, 8) is None  # dX: [K, N] rows
    why = {
        "fp32": unit_gemm_sm90.supports([(a.float(), w.t())], 8),
        "width": unit_gemm_sm90.supports([(a[:, :256], w.t()[:256])], 8),
        "mixed": unit_gemm_sm90.supports([(a, w.t()), (a, w.t().contiguous())], 8),
        "N": unit_gemm_sm90.supports([(a, w.t()[:, :10])], 8),
        "misaligned": unit_gemm_sm90.supports([(a, w.t().contiguous()[:, 1:9])], 8),
        "a": unit_gemm_sm90.supports([(a.t().contiguous().t(), w.t())], 8),
    }
    assert "fp32" in why["fp32"] and "unit width 32" in why["width"] and "mixed" in why["mixed"]
    assert "N = 10" in why["N"] and "16-byte" in why["misaligned"] and "row-major" in why["a"]


def test_unit_mm_gluon_config_errors_name_the_allowed_set():
    """An explicit IMPL that cannot be honoured raises (never a silent fallback): wrong device, tiles, stages."""
    from h3lab.triton import unit_gemm_sm90

    cfg = gemm_host.kernel_config("unit_gemm", NODE, ieee=False) | {"IMPL": "gluon"}
    unit_gemm_sm90.check_config(cfg, (9, 0))  # the pinned sm90 config passes
    cases = [
        ({}, (10, 0), r"capability \(10, 0\); allowed: \(9, 0\)"),
        ({"num_stages": 1}, (9, 0), r"num_stages=1; allowed: \[3, 4\]"),
        ({"num_stages": 4, "LVL2_SMEM": True}, (9, 0), r"num_stages=4; allowed: \[3\]"),
        ({"BLOCK_K": 32}, (9, 0), r"BLOCK_K=32; allowed: \[64\]"),
        ({"BLOCK_N": 256}, (9, 0), r"BLOCK_N=256; allowed: \[128\]"),
        ({"num_warps": 4}, (9, 0), r"num_warps=4; allowed: \[8\]"),
    ]
    for over, cap, match in cases:
        with pytest.raises(ValueError, match=match):
            unit_gemm_sm90.check_config(cfg | over, cap)
    a = _randn(5, 8 * 32, seed=3)
    with pytest.raises(ValueError, match=r"IMPL='cuda'; allowed: \['triton', 'gluon'\]"):
        unit_gemm.unit_mm([(a, a.t())], 8, node=NODE, config=_tc("unit_gemm") | {"IMPL": "cuda"})


def test_unit_mm_runs_gluon_only_where_it_can_and_checks_the_config_there(monkeypatch):
    """The dispatch of unit_mm, as on an H200 (interpreter off, capability 9.0; nothing launches): a call
    the Gluon kernel does not support goes to the Triton kernel without a Gluon config check (the pinned
    fp32 entry has Triton tiles), a call it supports with a config it cannot honour raises."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    a = _randn(5, 8 * 64, seed=4, dtype=BF16)
    w = _randn(16, 8 * 64, seed=5, dtype=BF16)
    dev = torch.device("cpu")
    bf16, ieee = (gemm_host.kernel_config("unit_gemm", NODE, ieee=flag) for flag in (False, True))
    assert unit_gemm.runs_gluon([(a, w.t())], 8, bf16, dev)
    assert ieee["IMPL"] == "triton" and not unit_gemm.runs_gluon([(a.float(), w.t())], 8, ieee, dev)
    bad = bf16 | {"num_stages": 1}
    assert not unit_gemm.runs_gluon([(a.float(), w.t())], 8, bad, dev)  # not supported: never checked
    with pytest.raises(ValueError, match="num_stages=1"):
        unit_gemm.runs_gluon([(a, w.t())], 8, bad, dev)
    assert not unit_gemm.runs_gluon([(a, w.t())], 8, bf16 | {"IMPL": "triton"}, dev)


def test_unit_mm_gluon_compiles_for_sm90_without_spills():
    """No GPU needed: the Gluon kernel builds for sm90 with the installed Triton (its API moves between
    releases), every variant the launcher picks keeps both FP32 tiles in registers (no stack), fits
    the 227 KiB of shared memory and keeps one wgmma in flight in the chunk loop (waits 1, then 0).
    A subprocess: this module runs under TRITON_INTERPRET=1, under which Gluon cannot compile."""
    import json
    import subprocess
    import sys

    from h3lab.bench import compile_sm90

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "h3lab.bench.compile_sm90", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    variants = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(variants) == len(compile_sm90.VARIANTS)
    for v in variants:
        assert v["stack_bytes"] == 0 and v["registers"] <= 255, v
        assert v["shared_bytes"] <= compile_sm90.SM90_SHARED_BYTES, v
        assert v["wgmma_waits"] == ["1", "0"], v


@gpu
@pytest.mark.parametrize("name", list(REAL))
def test_gpu_unit_mm_gluon_equals_triton(name):
    """The Gluon Hopper kernel (unit_gemm_sm90) and the Triton kernel give the same bytes: every row
    count, every TP rank's subtree (units [r*per, (r+1)*per) of 8), both places for level 2."""
    if configs.node_of("cuda") != "sm90":
        pytest.skip("the Gluon unit-tree kernel is written for sm90 (wgmma, TMA)")
    from h3lab.triton import unit_gemm_sm90

    kps, N, w_major = REAL[name]
    pieces = _pieces(4111, kps, N, 8, seed=75, device="cuda", dtype=BF16, w_major=w_major)
    base = gemm_host.kernel_config("unit_gemm", "sm90", ieee=False)
    variants = {
        "gluon_s4_l2": base | {"IMPL": "gluon", "num_stages": 4, "LVL2_SMEM": False},
        "gluon_s3_smem": base | {"IMPL": "gluon", "num_stages": 3, "LVL2_SMEM": True},
    }
    ref_cfg = base | {"IMPL": "triton"}
    for rows in (1, 3, 17, 264, 4111):
        for tp in (1, 2, 4, 8):
            per = 8 // tp
            for r in range(tp):
                part = [(a[:rows], b) for a, b in _slice_units(pieces, r * per, (r + 1) * per, 8)]
                assert unit_gemm_sm90.supports(part, per) is None, f"{name}: the Gluon kernel must take it"
                ref = unit_gemm.unit_mm(part, per, config=ref_cfg)
                for label, cfg in variants.items():
                    got = unit_gemm.unit_mm(part, per, config=cfg)
                    assert_bitwise(got, ref, f"{name} {label}: rows {rows}, TP{tp} rank {r}")


@gpu
def test_gpu_unit_mm_gluon_edges():
    """Edges the real shapes miss: a ragged last column tile (N = 300), pieces of different unit widths
    (14 and 28 chunks), rows of exact zeros (+0 and -0 products, where the chain's start decides the
    sign of a zero: both kernels start from +0)."""
    if configs.node_of("cuda") != "sm90":
        pytest.skip("the Gluon unit-tree kernel is written for sm90 (wgmma, TMA)")
    from h3lab.triton import unit_gemm_sm90

    base = gemm_host.kernel_config("unit_gemm", "sm90", ieee=False)
    gluon_cfg, triton_cfg = base | {"IMPL": "gluon"}, base | {"IMPL": "triton"}
    ragged = _pieces(300, (896,), 300, 8, seed=110, device="cuda", dtype=BF16)
    mixed = _pieces(264, (896, 1792), 5376, 8, seed=111, device="cuda", dtype=BF16, w_major=False)
    zeros = _pieces(264, (896,), 5376, 8, seed=112, device="cuda", dtype=BF16)
    zeros[0][0][5:9] = 0.0
    zeros[0][0][7] = -0.0
    for label, pieces in (("ragged N", ragged), ("unit widths 896, 1792", mixed), ("zero rows", zeros)):
        assert unit_gemm_sm90.supports(pieces, 8) is None, label
        got = unit_gemm.unit_mm(pieces, 8, config=gluon_cfg)
        assert_bitwise(got, unit_gemm.unit_mm(pieces, 8, config=triton_cfg), label)
    assert bool((unit_gemm.unit_mm(zeros, 8, config=gluon_cfg)[5:9] == 0).all()), "zero rows give zeros"
