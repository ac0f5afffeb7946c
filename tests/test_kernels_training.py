"""The training step's kernels against their torch references, byte for byte: the float32 modules'
chain GEMM (h3lab.triton.chain), the clip's sums of squares (h3lab.triton.squares) and AdamW's
update with its write-back (h3lab.triton.adamw).

Without CUDA they run under the Triton interpreter at small sizes (none uses tl.dot; every
operation is a numpy float32 elementwise op, IEEE, the same on every CPU; the bf16 write-back is
integer arithmetic); with CUDA the `gpu` tests compare them with the references run on the GPU at
the real H3 shapes: pytest -m gpu tests/test_kernels_training.py

Inputs hold what moves bits when an operation is fused, approximated or flushed: signed zeros,
FP32 denormals (squares and products that underflow), ragged tails and strided views.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import Tensor

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the kernels are Triton kernels)")

from h3lab.ops import adamw as ref_adamw
from h3lab.ops.chain import chain_mm as ref_chain_mm
from h3lab.ops.squares import sum_of_squares
from h3lab.train.adamw import AdamWHyper, PieceState, step_scalars
from h3lab.triton import adamw, chain, configs, squares
from tests.conftest import assert_bitwise, gpu_kernels

NODE = "sm90"
F32, BF16 = torch.float32, torch.bfloat16
interp = pytest.mark.skipif(not configs.interpreting(), reason="interpreter tests: TRITON_INTERPRET=1")


gpu = gpu_kernels(__file__)


def _awkward(*shape: int, seed: int, dtype: torch.dtype = F32, device: str = "cpu", scale: float = 1.0):
    """Random values with signed zeros and values whose squares and products underflow to denormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    flat = x.view(-1)
    k = flat.numel()
    if k >= 8:
        flat[k // 7] = 0.0
        flat[k // 5] = -0.0
        flat[k // 3] = 3e-20  # its square is an FP32 denormal
        flat[k // 2] = -2e-21
    return x.to(device=device, dtype=dtype)


# ---- the chain GEMM ---------------------------------------------------------------------------


# operand dtypes as the model passes them (FP32 x FP32 forward, bf16 x FP32 and FP32 x bf16 weight
# gradients), bf16 x bf16 as mm_few_k may; scale 1e-20: products below FP32's normal range
CHAIN_CASES = [(F32, F32, 1.0), (BF16, F32, 1.0), (F32, BF16, 1.0), (BF16, BF16, 1.0), (F32, F32, 1e-20)]


def _check_chain(M: int, K: int, N: int, case: tuple, seed: int, device: str, node: str | None) -> None:
    a_dtype, b_dtype, scale = case
    a = _awkward(M, K, seed=seed, dtype=a_dtype, device=device, scale=scale)
    w = _awkward(N, K, seed=seed + 1, dtype=b_dtype, device=device, scale=1e-3 * scale)
    b = w.t()  # a weight's transpose, as the float32 modules pass it
    assert_bitwise(chain.chain_mm(a, b, node=node), ref_chain_mm(a, b), f"chain_mm {M}x{K}x{N} {case}")


@interp
@pytest.mark.parametrize(("M", "K", "N"), [(37, 29, 70), (3, 200, 5), (1, 1, 1), (65, 0, 3)])
@pytest.mark.parametrize("case", CHAIN_CASES)
def test_chain_mm_is_the_reference_chain(M, K, N, case):
    _check_chain(M, K, N, case, seed=M + K + N, device="cpu", node=NODE)


@interp
@pytest.mark.parametrize("unroll", [2, 3, 8])
def test_chain_mm_unrolled_is_the_reference_chain(unroll):
    """UNROLL steps of k loaded together, added in order; K not a multiple of UNROLL (a tail of +0 adds)."""
    for M, K, N in [(37, 29, 70), (3, 200, 5), (5, 1, 2)]:
        for case in CHAIN_CASES:
            a_dtype, b_dtype, scale = case
            a = _awkward(M, K, seed=K, dtype=a_dtype, device="cpu", scale=scale)
            b = _awkward(N, K, seed=K + 1, dtype=b_dtype, device="cpu", scale=1e-3 * scale).t()
            cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "UNROLL": unroll, "num_warps": 1}
            assert_bitwise(chain.chain_mm(a, b, config=cfg), ref_chain_mm(a, b), f"chain_mm {M}x{K}x{N} {case}")
    with pytest.raises(ValueError, match=r"chain_mm config keys \['BLOCK_M'\]; allowed: exactly"):
        chain.chain_mm(a, b, config={"BLOCK_M": 16})


@interp
@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("UNROLL", 0, "an int >= 1"),
        ("UNROLL", -1, "an int >= 1"),
        ("BLOCK_M", 24, "a power of two"),
        ("num_warps", 2.0, "a power of two"),
    ],
)
def test_chain_mm_refuses_a_config_value_it_cannot_run(key, value, allowed):
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "UNROLL": 8, "num_warps": 4} | {key: value}
    with pytest.raises(ValueError, match=rf"chain_mm config {key} {value!r}; allowed: {allowed}"):
        chain.chain_mm(a, b, config=cfg)


@interp
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in numpy: the NaN wanted
def test_chain_mm_special_values_are_the_reference_chain_on_a_tail():
    """-0, Inf and NaN operands, K not a multiple of the pinned UNROLL: the +0 adds past K leave them."""
    _special_chain("cpu", NODE)


@gpu
def test_chain_mm_special_values_are_the_reference_chain_on_a_tail_on_gpu():
    _special_chain("cuda", None)


def _special_chain(device: str, node: str | None) -> None:
    for K in (1, 7, 13):
        a = torch.randn(9, K, generator=torch.Generator().manual_seed(K)).to(device)
        b = torch.randn(K, 6, generator=torch.Generator().manual_seed(K + 1)).to(device)
        a[0] = -0.0
        b[:, 1] = -0.0
        a[2, 0], a[3, -1], b[0, 2] = math.inf, -math.inf, math.nan
        assert_bitwise(chain.chain_mm(a, b, node=node), ref_chain_mm(a, b), f"chain_mm special values, K {K}")


@gpu
@pytest.mark.parametrize(
    ("M", "K", "N"), [(4096, 5376, 96), (96, 3000, 5376), (3, 5376, 2688), (37, 29, 70), (96, 3001, 130), (5, 1, 2)]
)
@pytest.mark.parametrize("case", CHAIN_CASES)
def test_chain_mm_is_the_reference_chain_on_gpu(M, K, N, case):
    _check_chain(M, K, N, case, seed=M + K + N, device="cuda", node=None)


# ---- sums of squares --------------------------------------------------------------------------


def _pieces(device: str, big: bool) -> list[torch.Tensor]:
    sizes = [0, 1, 1023, 1024, 1025, 5000] + ([3 * 1024 * 1024 + 7] if big else [])
    out = [_awkward(n, seed=n, device=device, scale=1e-3) for n in sizes]
    w = _awkward(48, 40, seed=3, dtype=BF16, device=device)
    out += [w[:, 8:16], w.t(), _awkward(5, seed=9, device=device).squeeze()[0]]  # a unit's columns, 0-d
    out += [_awkward(3000, seed=4, device=device, scale=1e-21)]  # every square below FP32's normal range
    out += [torch.zeros(0, 3, 4, device=device), _awkward(2, 3, 40, seed=6, device=device)]  # 3-D
    return out


def _check_squares(xs: list[torch.Tensor], node: str | None) -> None:
    got = squares.sums_of_squares(xs, node=node)
    assert_bitwise(got, torch.stack([sum_of_squares(x) for x in xs]), "sums_of_squares")


@interp
def test_sums_of_squares_are_the_reference_trees():
    _check_squares(_pieces("cpu", big=False), NODE)


@gpu
def test_sums_of_squares_are_the_reference_trees_on_gpu():
    _check_squares(_pieces("cuda", big=True), None)


def test_sums_of_squares_refuse_bad_inputs():
    with pytest.raises(ValueError, match="no tensors"):
        squares.sums_of_squares([], node=NODE)
    with pytest.raises(ValueError, match=r"tensor 0 is torch\.int64"):
        squares.sums_of_squares([torch.arange(3)], node=NODE)


# ---- AdamW ------------------------------------------------------------------------------------


def _piece(shape: tuple[int, ...], weight_dtype: torch.dtype, device: str, seed: int):
    """(weight, the tensor it views, or None): a 2-D weight is the middle third of the columns of a
    wider one, as a rank's units' columns are; a 1-D one of 299 elements starts one element into
    its buffer (an address no vectorised load may assume); other shapes are whole."""
    if len(shape) == 2:
        full = _awkward(shape[0], 3 * shape[-1], seed=seed, dtype=weight_dtype, device=device)
        return full[:, shape[-1] : 2 * shape[-1]], full
    if shape == (299,):
        full = _awkward(300, seed=seed, dtype=weight_dtype, device=device)
        return full[1:], full
    return _awkward(*shape, seed=seed, dtype=weight_dtype).to(device), None


def _check_adamw(
    shape: tuple[int, ...], weight_dtype: torch.dtype, device: str, node: str | None, grad_case=(BF16, 1e-2)
) -> None:
    """`shape` in one adamw_updates call with pieces of other shapes (0-d, 1-D, a contiguous 2-D) of
    both weight dtypes (their gradients in `grad_case`'s dtype): three steps, every byte against the
    reference's, the columns beside a view untouched, no piece flagged."""
    grad_dtype, grad_scale = grad_case
    shapes = [(shape, weight_dtype), ((), F32), ((300,), BF16), ((299,), weight_dtype), ((7, 5), weight_dtype)]
    shapes.append(((3, 1), F32))
    refs, gots = [], []
    for k, (sh, dt) in enumerate(shapes):
        weight, full = _piece(sh, dt, device, seed=5 + k)
        for out in (refs, gots):
            f = None if full is None else full.clone()
            w = weight.clone() if f is None else f[1:] if len(sh) == 1 else f[:, sh[-1] : 2 * sh[-1]]
            out.append((PieceState.init(weight), w, f))
    hyper = AdamWHyper(lr=3e-3, weight_decay=0.05)
    for t in range(1, 4):
        grads = [
            _awkward(*sh, seed=10 * t + k, dtype=grad_dtype, device=device, scale=grad_scale)
            for k, (sh, _) in enumerate(shapes)
        ]
        coef = torch.tensor(0.625, dtype=F32, device=device)
        s = step_scalars(hyper, 0.9**t, 0.999**t, torch.device(device))
        ops = [
            [(st.master, st.exp_avg, st.exp_avg_sq, g, w) for (st, w, _), g in zip(side, grads, strict=True)]
            for side in (refs, gots)
        ]
        want = ref_adamw.adamw_updates(ops[0], coef, s)
        got = adamw.adamw_updates(ops[1], coef, s, node=node)
        assert not want.any(), "a finite update flagged"
        assert_bitwise(got, want, f"step {t} flags")
        for k, ((r, rw, rf), (g, gw, gf)) in enumerate(zip(refs, gots, strict=True)):
            for field in ("master", "exp_avg", "exp_avg_sq"):
                assert_bitwise(getattr(g, field), getattr(r, field), f"step {t} piece {k} {field}")
            assert_bitwise(gw, rw, f"step {t} piece {k} weight")
            if rf is not None:
                assert_bitwise(gf, rf, f"step {t} piece {k}: the columns beside the view are untouched")


# gradients: bf16 and fp32; scale 1e-20: g * g and the second moment below FP32's normal range
GRAD_CASES = [(BF16, 1e-2), (F32, 1e-2), (F32, 1e-20)]


@interp
@pytest.mark.parametrize("shape", [(1000,), (37, 24)])
@pytest.mark.parametrize("weight_dtype", [BF16, F32])
@pytest.mark.parametrize("grad_case", GRAD_CASES)
def test_adamw_updates_are_the_reference(shape, weight_dtype, grad_case):
    _check_adamw(shape, weight_dtype, "cpu", NODE, grad_case)


@gpu
@pytest.mark.parametrize("shape", [(5376,), (5376, 672), (1792, 5376)])
@pytest.mark.parametrize("weight_dtype", [BF16, F32])
@pytest.mark.parametrize("grad_case", GRAD_CASES)
def test_adamw_updates_are_the_reference_on_gpu(shape, weight_dtype, grad_case):
    _check_adamw(shape, weight_dtype, "cuda", None, grad_case)


FLAG_CASES = [  # (weight dtype, the master's value, a strided view?, flagged)
    (BF16, 3.3999e38, False, True),  # finite in FP32, Inf once rounded to bf16
    (F32, 3.3999e38, False, False),
    (BF16, 1.0, False, False),
    (F32, float("nan"), False, True),
    (BF16, 3.3999e38, True, True),  # [8, 16] columns of an [8, 48] weight: the aligned tiled build
    (F32, float("nan"), True, True),
    (F32, 1.0, True, False),
]


def _flags_of_overflow(device: str, node: str | None) -> tuple[Tensor, Tensor]:
    """Masters of FLAG_CASES under a zero-lr update (the master stays, the weight is its rounding):
    the reference's and the kernel's flags."""
    hyper = AdamWHyper(lr=0.0, weight_decay=0.0)
    s = step_scalars(hyper, 0.9, 0.999, torch.device(device))
    coef = torch.tensor(1.0, dtype=F32, device=device)
    out = []
    for fn, kw in ((ref_adamw.adamw_updates, {}), (adamw.adamw_updates, {"node": node})):
        pieces = []
        for dtype, value, strided, _ in FLAG_CASES:
            shape = (8, 16) if strided else (70,)
            master = torch.full(shape, value, dtype=F32, device=device)
            w = torch.zeros(8, 48, dtype=dtype, device=device)[:, 16:32] if strided else torch.zeros(70, dtype=dtype)
            w = w.to(device)
            pieces.append((master, torch.zeros_like(master), torch.zeros_like(master), torch.zeros_like(master), w))
        out.append(fn(pieces, coef, s, **kw))
    return out[0], out[1]


@interp
def test_adamw_updates_flag_a_weight_that_overflowed_its_dtype():
    want, got = _flags_of_overflow("cpu", NODE)
    assert want.tolist() == [c[-1] for c in FLAG_CASES]
    assert_bitwise(got, want, "flags")


@gpu
def test_adamw_updates_flag_a_weight_that_overflowed_its_dtype_on_gpu():
    want, got = _flags_of_overflow("cuda", None)
    assert want.tolist() == [c[-1] for c in FLAG_CASES]
    assert_bitwise(got, want, "flags")


def _held_back(device: str, node: str | None) -> None:
    """go = false: the reference and the kernel leave every master, moment and weight as it was and
    set no flag, on updates that would have changed every element (and flagged the overflowing ones)."""
    hyper = AdamWHyper(lr=1e-2)
    s = step_scalars(hyper, 0.9, 0.999, torch.device(device))
    coef = torch.tensor(0.5, dtype=F32, device=device)
    g = torch.Generator().manual_seed(5)
    for fn, kw in ((ref_adamw.adamw_updates, {}), (adamw.adamw_updates, {"node": node})):
        pieces = []
        for dtype, value, strided, _ in FLAG_CASES:
            shape = (8, 16) if strided else (70,)
            master, m, v, grad = (torch.randn(shape, generator=g).to(device) for _ in range(4))
            master[0] = value
            w = torch.randn(8, 48, generator=g).to(device, dtype)[:, 16:32] if strided else master.to(dtype, copy=True)
            pieces.append((master, m, v.abs(), grad, w))
        before = [[t.clone() for t in piece] for piece in pieces]
        flags = fn(pieces, coef, s, torch.tensor(False, device=device), **kw)
        assert flags.tolist() == [False] * len(pieces), fn
        for k, (piece, was) in enumerate(zip(pieces, before, strict=True)):
            for name, t, t0 in zip(("master", "exp_avg", "exp_avg_sq", "grad", "weight"), piece, was, strict=True):
                assert_bitwise(t, t0, f"{fn.__module__} piece {k} {name} with go false")
        flags = fn(pieces, coef, s, torch.tensor(True, device=device), **kw)  # the same update, let run
        assert flags.tolist() == [c[-1] for c in FLAG_CASES], fn
        for piece, was in zip(pieces, before, strict=True):  # it ran: the finite masters moved
            assert not torch.equal(piece[0][1:], was[0][1:]), fn


@interp
def test_adamw_updates_held_back_change_nothing():
    _held_back("cpu", NODE)


@gpu
def test_adamw_updates_held_back_change_nothing_on_gpu():
    _held_back("cuda", None)


@interp
@pytest.mark.parametrize("value", [math.nan, math.inf, 3e19])  # 3e19: finite, its square overflows FP32
def test_a_step_refused_through_the_kernel_changes_nothing(value):
    """AdamW.step with the kernel's updates queued behind a non-finite norm: NonFiniteGradError, and
    every weight, master, moment, the step count and the beta powers as they were."""
    from h3lab.backend import get_backend
    from h3lab.comm import LocalComm
    from h3lab.train.adamw import AdamW, NonFiniteGradError
    from tests.train_ranks import NARROW, model_weights, random_grads

    class KernelUpdates(type(get_backend("torch"))):
        def adamw_updates(self, pieces, coef, s, go=None):
            return adamw.adamw_updates(pieces, coef, s, go, node=NODE)

    config = NARROW.replace(num_layers=1)
    weights = model_weights(config, range(1), range(8), seed=3)
    opt = AdamW(weights, config=config, comm=LocalComm(), hyper=AdamWHyper(lr=1e-3), backend=KernelUpdates())
    opt.step(random_grads(weights, config, seed=4, scale=1e-2))
    before = {p: [t.clone() for t in (w, *vars(opt.state[p]).values())] for p, w in opt.weights.items()}
    counts = (opt.step_count, opt._beta_pows)
    grads = random_grads(weights, config, seed=5, scale=1e-2)
    first = next(iter(grads))
    grads[first] = grads[first].clone()
    grads[first].view(-1)[0] = value
    with pytest.raises(NonFiniteGradError, match=r"step 2: gradient norm .*step refused, nothing changed"):
        opt.step(grads)
    assert (opt.step_count, opt._beta_pows) == counts
    for p, was in before.items():
        for name, t, t0 in zip(
            ("weight", "master", "exp_avg", "exp_avg_sq"),
            (opt.weights[p], *vars(opt.state[p]).values()),
            was,
            strict=True,
        ):
            assert_bitwise(t, t0, f"{p} {name} after a refused step")


def test_adamw_updates_refuse_what_they_cannot_read():
    m, coef = torch.zeros(4, 6)[:, :3], torch.tensor(1.0)
    with pytest.raises(
        ValueError,
        match=r"adamw_updates: piece 0: master is torch.float32 \[4, 3\] strides \(6, 1\); allowed: contiguous",
    ):
        adamw.adamw_updates([(m, m, m, m, m)], coef, torch.zeros(8), node=NODE)
    m = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"adamw_updates: s has strides \(2,\); allowed: contiguous"):
        adamw.adamw_updates([(m, m, m, m, m)], coef, torch.zeros(16)[::2], node=NODE)
    with pytest.raises(ValueError, match=r"adamw_updates: go torch.int64 \[1\]; allowed: a 0-d torch.bool"):
        adamw.adamw_updates([(m, m, m, m, m)], coef, torch.zeros(8), torch.ones(1, dtype=torch.int64), node=NODE)
    with pytest.raises(ValueError, match=r"adamw_updates: piece 1: a 3-D piece"):
        x = torch.zeros(2, 2, 2)
        adamw.adamw_updates([(m, m, m, m, m), (x, x, x, x, x)], coef, torch.zeros(8), node=NODE)


def test_chain_mm_refuses_operands_its_offsets_cannot_reach():
    big = torch.empty(2**16, 2**15 + 1, dtype=BF16, device="meta")  # 2^31 + 2^16 elements, no memory
    with pytest.raises(ValueError, match=r"chain_mm: a_MK .*allowed: at most 2147483647 elements each"):
        chain.chain_mm(big, torch.empty(2**15 + 1, 4, dtype=BF16, device="meta"), node=NODE)
