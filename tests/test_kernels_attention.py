"""Triton attention (h3lab.triton.attention): bitwise invariance to query/key/head layout and repeats,
agreement with a float64 reference.

Without CUDA the kernels run under the Triton interpreter (set below, before triton is imported) in
FP32 with IEEE dots: the interpreter's bf16 is numerically wrong. With CUDA the `gpu` tests run the
compiled bf16 kernels at head_dim 128; run them in their own process if another test module forces
TRITON_INTERPRET=1:  pytest -m gpu tests/test_kernels_attention.py

Why the interpreter's bits are the same on every CPU: its tl.dot is tests/conftest.py's chain_dot,
one FP32 chain per element from the accumulator, k ascending, numpy elementwise ops. The
interpreter's own np.matmul goes through the host's BLAS, which on some CPUs (OpenBLAS' Haswell and
Zen kernels) sums a query row by its place in the tile, so the query-slice, CP and head_dim 128
tests failed there. The rest is numpy elementwise math (exp2, log2: an element's value from its
input alone) and row reductions (tl.max, tl.sum) over tiles of the one shape every compared call has.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the attention kernels are Triton kernels)")

from h3lab.ops import attention as ref_ops
from h3lab.ops.fixed import round_to
from h3lab.triton import attention as att
from h3lab.triton.configs import interpreting
from tests.conftest import assert_bitwise, gpu_kernels

# tl.dot under the interpreter: our FP32 chain, not the host BLAS (tests/conftest.py chain_dot)
pytestmark = pytest.mark.usefixtures("chain_dot")

interp = pytest.mark.skipif(
    not interpreting(), reason="interpreter tests: run with TRITON_INTERPRET=1 (the default without CUDA)"
)


gpu = gpu_kernels(__file__)


NAMES = ("o", "o_ref", "lse", "delta", "dq", "dk", "dv")
QUERY_SIDE = ("o", "o_ref", "dq")  # [Q, H, Dh]; lse and delta are [H, Q]
# FP32 (interpreter): every product and sum is one FP32 rounding; over <= 200 keys and 128 channels
# the relative L2 errors against float64 (tl.dot as chain_dot) are 4e-8..5e-7, so 5e-6 leaves 10x margin.
TOL_FP32 = 5e-6
# bf16 (GPU): P and dS enter the tensor cores as bf16 (relative rounding 2^-9 = 2e-3 per element) and
# o is rounded to bf16. A CPU emulation of exactly these roundings (Q=517, K=389, Dh=128) gives
# relative L2 errors 1.3e-3..3.7e-3 against float64, torch's bf16 SDPA 1.6e-3..5.3e-3; 8e-3 is 2x.
TOL_BF16 = 8e-3


def _inputs(n_q: int, n_k: int, heads: int, dh: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n: torch.randn(n, heads, dh, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(n_q), mk(n_k), mk(n_k), mk(n_q)  # q, k, v, dO


def _run(q, k, v, do, scale, node, config=None, q_kv=None):
    """Every output of the kernels. `q_kv` = (q, dO, lse, delta) of the full query set for dk/dv."""
    cfg = config or {}
    o, o_ref, (lse,) = att.attention_fwd(q, k, v, scale, q.dtype, node=node, config=cfg.get("fwd"))
    delta = att.attention_delta(do, o_ref, node=node, config=cfg.get("delta"))
    dq = att.attention_bwd_q(q, do, (lse,), delta, k, v, scale, node=node, config=cfg.get("bwd_q"))
    qa, doa, lsea, deltaa = q_kv or (q, do, lse, delta)
    dk, dv = att.attention_bwd_kv(qa, doa, (lsea,), deltaa, k, v, scale, node=node, config=cfg.get("bwd_kv"))
    return dict(zip(NAMES, (o, o_ref, lse, delta, dq, dk, dv), strict=True))


def _ref64(q, k, v, do, scale):
    """Softmax attention and its autograd gradients in float64 from the same (rounded) inputs."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v64)
    o.backward(do.double())
    lse2 = torch.logsumexp(s, -1) / math.log(2)
    delta = (do.double() * o).sum(-1).T
    return dict(
        o=o.detach(), o_ref=o.detach(), lse=lse2.detach(), delta=delta.detach(), dq=q64.grad, dk=k64.grad, dv=v64.grad
    )


def _rel_l2(x, r) -> float:
    return float((x.double() - r).norm() / r.norm())


def _check_invariance(q, k, v, do, scale, node, config=None, q_cuts=(), k_cuts=(), head_sets=()):
    full = _run(q, k, v, do, scale, node, config)
    assert_bitwise_all(full, _run(q, k, v, do, scale, node, config), "repeat")
    for lo, hi in q_cuts:  # a query row's results: independent of the call's rows and offsets
        part = _run(q[lo:hi], k, v, do[lo:hi], scale, node, config, q_kv=(q, do, full["lse"], full["delta"]))
        for n in QUERY_SIDE:
            assert_bitwise(part[n], full[n][lo:hi], f"{n} rows {lo}:{hi}")
        for n in ("lse", "delta"):
            assert_bitwise(part[n], full[n][:, lo:hi], f"{n} rows {lo}:{hi}")
        for n in ("dk", "dv"):  # same keys, same full query set
            assert_bitwise(part[n], full[n], f"{n} with query rows {lo}:{hi} in the call")
    for lo, hi in k_cuts:  # a key row's dk/dv: independent of which keys share the call
        dk, dv = att.attention_bwd_kv(
            q,
            do,
            (full["lse"],),
            full["delta"],
            k[lo:hi],
            v[lo:hi],
            scale,
            node=node,
            config=(config or {}).get("bwd_kv"),
        )
        assert_bitwise(dk, full["dk"][lo:hi], f"dk keys {lo}:{hi}")
        assert_bitwise(dv, full["dv"][lo:hi], f"dv keys {lo}:{hi}")
    for hs in head_sets:  # a head's results: independent of the other heads (TP splits heads)
        for cont in (True, False):  # a contiguous copy (what TP ranks hold) and a strided view
            qs, ks, vs, dos = (t[:, hs].contiguous() if cont else t[:, hs] for t in (q, k, v, do))
            part = _run(qs, ks, vs, dos, scale, node, config)
            for n in NAMES:
                assert_bitwise(part[n], full[n][hs] if n in ("lse", "delta") else full[n][:, hs], f"{n} heads {hs}")
    return full


def assert_bitwise_all(a: dict, b: dict, what: str) -> None:
    for n in NAMES:
        assert_bitwise(a[n], b[n], f"{what}: {n}")


def _check_accuracy(out: dict, ref: dict, tol: float) -> dict[str, float]:
    errs = {n: _rel_l2(out[n].cpu(), ref[n]) for n in NAMES}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative L2 error above {tol}: {bad} (all: {errs})"
    return errs


# ---- interpreter: FP32, small odd shapes --------------------------------------------------------


@interp
@pytest.mark.parametrize("n_q, n_k, heads", [(37, 61, 3), (131, 97, 2)])
def test_interp_matches_float64_and_reference(n_q, n_k, heads):
    q, k, v, do = _inputs(n_q, n_k, heads, 32, torch.float32, "cpu")
    scale = 32**-0.5
    out = _run(q, k, v, do, scale, "sm90")
    _check_accuracy(out, _ref64(q, k, v, do, scale), TOL_FP32)
    # the torch canonical arithmetic (h3lab.ops.attention) agrees within the same FP32 tolerance
    o32, rowmax, denom = ref_ops.attention_fwd(q, k, v, scale)
    rd = ref_ops.attention_delta(do, o32)
    dq = ref_ops.attention_bwd_q(q, do, rowmax, denom, rd, k, v, scale)
    dk, dv = ref_ops.attention_bwd_kv(q, do, rowmax, denom, rd, k, v, scale)
    lse2 = (rowmax.double() + denom.double().log()) / math.log(2)
    torch_ref = dict(o=o32, o_ref=o32, lse=lse2, delta=rd, dq=dq, dk=dk, dv=dv)
    _check_accuracy(out, {n: t.double() for n, t in torch_ref.items()}, TOL_FP32)


@interp
@pytest.mark.parametrize("n_q, n_k, heads", [(37, 61, 3), (131, 97, 3)])
def test_interp_invariance(n_q, n_k, heads):
    q, k, v, do = _inputs(n_q, n_k, heads, 32, torch.float32, "cpu", seed=1)
    cuts_q = [(1, n_q), (3, 30), (n_q // 2, n_q // 2 + 1), (0, 33 if n_q > 33 else n_q - 2)]
    cuts_k = [(1, n_k), (5, 37), (n_k - 3, n_k - 2)]
    _check_invariance(q, k, v, do, 0.17, "sm90", q_cuts=cuts_q, k_cuts=cuts_k, head_sets=[slice(1, 3), [2, 0]])


@interp
def test_interp_context_parallel_split_reproduces_single_call():
    """What block.py does under CP: each rank runs fwd/dq on its queries, dk/dv on its keys over the
    gathered queries and stats (stats arrive as [H, Q] views of a [Q, H] gather)."""
    q, k, v, do = _inputs(131, 97, 2, 32, torch.float32, "cpu", seed=2)
    scale = 32**-0.5
    full = _run(q, k, v, do, scale, "sm90")
    q_cuts, k_cuts = (0, 45, 46, 131), (0, 33, 71, 97)
    ranks = [_run(q[a:b], k, v, do[a:b], scale, "sm90") for a, b in itertools.pairwise(q_cuts)]
    gather = lambda n: torch.cat([r[n].T for r in ranks]).T  # noqa: E731  non-contiguous [H, Q]
    lse, delta = gather("lse"), gather("delta")
    assert not lse.is_contiguous()
    for n in QUERY_SIDE:
        assert_bitwise(torch.cat([r[n] for r in ranks]), full[n], f"CP {n}")
    for a, b in itertools.pairwise(k_cuts):
        dk, dv = att.attention_bwd_kv(q, do, (lse,), delta, k[a:b], v[a:b], scale, node="sm90")
        assert_bitwise(dk, full["dk"][a:b], f"CP dk {a}:{b}")
        assert_bitwise(dv, full["dv"][a:b], f"CP dv {a}:{b}")


@interp
def test_interp_rounded_output_and_fp32_reference():
    """out_dtype bf16: o_ref is the FP32 output itself, o is o_ref rounded once. The interpreter's FP32 ->
    bf16 cast truncates (the GPU rounds to nearest even, checked bitwise in test_gpu_accuracy_bf16), so
    here o is only checked to within one bf16 step of o_ref."""
    q, k, v, _ = _inputs(37, 61, 2, 32, torch.float32, "cpu", seed=5)
    o32, o32_ref, (lse32,) = att.attention_fwd(q, k, v, 0.2, torch.float32, node="sm90")
    assert o32_ref is o32
    o, o_ref, (lse,) = att.attention_fwd(q, k, v, 0.2, torch.bfloat16, node="sm90")
    assert o.dtype == torch.bfloat16 and o_ref.dtype == torch.float32
    assert_bitwise(o_ref, o32, "o_ref")
    assert_bitwise(lse, lse32, "lse")
    steps = o.view(torch.int16).int() - round_to(o32, torch.bfloat16).view(torch.int16).int()
    assert int(steps.abs().max()) <= 1


@interp
def test_interp_head_dim_128_pinned_tiles():
    """The Triton kernels' production tiles at head_dim 128 (sm100's pins: 128-row query blocks, 64/128-
    key blocks; sm90 pins dq to the Gluon kernel, which its GPU tests check) on ragged shapes."""
    q, k, v, do = _inputs(150, 203, 1, 128, torch.float32, "cpu", seed=3)
    scale = 128**-0.5
    full = _check_invariance(q, k, v, do, scale, "sm100", q_cuts=[(1, 149), (127, 130)], k_cuts=[(3, 200)])
    _check_accuracy(full, _ref64(q, k, v, do, scale), TOL_FP32)


@interp
def test_interp_rejects_what_has_no_pinned_tiles():
    q, k, v, _ = _inputs(5, 7, 1, 32, torch.float32, "cpu")
    for dh, match in ((48, "head_dim=48: must be a power of two"), (64, r"head_dim=64 .*allowed: \[32, 128\]")):
        qd, kd = torch.zeros(5, 1, dh), torch.zeros(7, 1, dh)
        with pytest.raises(ValueError, match=match):
            att.attention_fwd(qd, kd, kd, 1.0, torch.float32, node="sm90")
    with pytest.raises(ValueError, match="float32"):
        att.attention_fwd(q.bfloat16(), k.bfloat16(), v.bfloat16(), 1.0, torch.bfloat16, node="sm90")
    with pytest.raises(ValueError, match="agree on"):
        att.attention_fwd(q, k[:, :, :16], v[:, :, :16], 1.0, torch.float32, node="sm90")
    with pytest.raises(ValueError, match="at least one key"):
        att.attention_fwd(q, k[:0], v[:0], 1.0, torch.float32, node="sm90")
    _, o_ref, stats = att.attention_fwd(q, k, v, 1.0, torch.float32, node="sm90")
    delta = att.attention_delta(q, o_ref, node="sm90")
    with pytest.raises(ValueError, match=r"stats must be \(lse2,\)"):  # e.g. the torch backend's (rowmax, denom)
        att.attention_bwd_q(q, q, (*stats, stats[0]), delta, k, v, 1.0, node="sm90")
    with pytest.raises(ValueError, match="positive"):
        att.attention_bwd_kv(q, q, stats, delta, k, v, -1.0, node="sm90")
    with pytest.raises(ValueError, match="CUDA"):
        att.attention_fwd(q, k, v, 1.0, torch.float32)  # no node named, CPU tensors


# ---- GPU: bf16, head_dim 128, the pinned sm90 tiles ---------------------------------------------


def _gpu_case(n_q, n_k, heads, seed=0):
    q, k, v, do = _inputs(n_q, n_k, heads, 128, torch.bfloat16, "cuda", seed=seed)
    return q, k, v, do, 128**-0.5


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (264, 264, 7), (1031, 1031, 2)])
def test_gpu_invariance_bf16(n_q, n_k, heads):
    q, k, v, do, scale = _gpu_case(n_q, n_k, heads)
    cuts_q = [(1, n_q), (127, 129), (n_q // 3, n_q - 5), (255, 256)]
    cuts_k = [(1, n_k), (63, n_k - 64), (n_k - 1, n_k)]
    _check_invariance(
        q, k, v, do, scale, None, q_cuts=cuts_q, k_cuts=cuts_k, head_sets=[slice(1, heads), [heads - 1, 0]]
    )


@gpu
@pytest.mark.parametrize("amp", [1.0, 3.0])
def test_gpu_accuracy_bf16(amp):
    q, k, v, do, scale = _gpu_case(517, 389, 3, seed=4)
    q, k = (q.float() * amp).bfloat16(), (k.float() * amp).bfloat16()  # sharper softmax at amp 3
    out = _run(q, k, v, do, scale, None)
    assert_bitwise(out["o"], round_to(out["o_ref"], torch.bfloat16), "o = round_to_nearest_even(o_ref)")
    errs = _check_accuracy(out, _ref64(q.cpu(), k.cpu(), v.cpu(), do.cpu(), scale), TOL_BF16)
    print("relative L2 vs float64:", errs)
