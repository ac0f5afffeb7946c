"""The emulate-sm90 backend: GEMM calls of the tiny block give the H200's bits, the attention emulation
keeps the kernels' invariances, and the backend is built and refused where it should be.

The GEMM vectors are output elements of the H200's capture of the tiny block (golden.REFERENCE) with
the inputs they need (tests/data/emulate_sm90_vectors.json, h3lab.bench.emulate_vectors); their
weights are the reference problem's synthetic block, regenerated here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from h3lab.backend import EmulateSM90Backend, TorchBackend, get_backend
from h3lab.bench.capture import resolve
from h3lab.bench.emulate_vectors import unpack
from h3lab.bench.mma_cases import values
from h3lab.bench.probe_rng import Stream
from h3lab.emulate import attention, sfu
from h3lab.ops.fixed import exp
from h3lab.run import golden
from h3lab.run.problem import Problem
from tests.conftest import assert_bitwise

VECTORS = json.loads((Path(__file__).parent / "data" / "emulate_sm90_vectors.json").read_text())


@pytest.fixture(scope="module")
def reference_weights():
    return golden.REFERENCE.weights("cpu").tensors


def _call(be, v: dict, weights: dict) -> torch.Tensor:
    cols = torch.tensor(v["cols"])
    out_dtype = getattr(torch, v.get("out_dtype", "float32"))
    w = lambda ref: resolve(ref, {}, weights)[:, cols]  # noqa: E731  (a weight view b_KN, its sampled columns)
    if v["method"] == "mm":
        return be.mm(unpack(v["a"]), w(v["b"]), out_dtype)
    if v["method"] == "unit_reduce":
        return be.unit_reduce([(unpack(p["a"]), w(p["b"])) for p in v["pieces"]], v["num_units"])
    if v["method"] == "row_mm":
        return be.row_mm(unpack(v["a"]), unpack(v["b"]), unpack(v["order"]), out_dtype)
    return be.mm_few_k(unpack(v["a"]), unpack(v["b"]), out_dtype)


@pytest.mark.parametrize("v", VECTORS["calls"], ids=lambda v: f"{v['call']}-{v['method']}")
def test_gemm_calls_of_the_tiny_block_give_the_h200s_bits(v, reference_weights):
    assert_bitwise(_call(EmulateSM90Backend(), v, reference_weights), unpack(v["out"]), v["method"])


def test_the_torch_backends_chains_do_not_give_those_bits(reference_weights):
    # the vectors tell the kernels' arithmetic from the torch chains: a test that passes for both checks nothing
    v = next(v for v in VECTORS["calls"] if v["method"] == "unit_reduce")  # FP32 out: no rounding hides it
    got = _call(TorchBackend(), v, reference_weights)
    assert not torch.equal(got.view(torch.int32), unpack(v["out"]).view(torch.int32))


def _elementwise_sfu(monkeypatch):
    """Stand-ins for the special-function models, each a function of its element alone (IEEE
    operations only: no library exp or log, whose bits may depend on an element's position): only for
    the invariances below, which hold for any such function. They are no model of the GPU."""
    f64 = torch.float64
    monkeypatch.setattr(sfu, "ex2_approx_ftz", lambda x: exp(x * math.log(2.0)))
    monkeypatch.setattr(sfu, "div_full", lambda a, b: (a.to(f64) / b.to(f64)).to(torch.float32))
    monkeypatch.setattr(sfu, "log2_libdevice", lambda x: sum(torch.frexp(x)).to(torch.float32))


def _qkv(Q: int, K: int, dh: int = 32):
    s = Stream(21)
    return [values(s, (n, 2, dh), -3, 1, torch.bfloat16) for n in (Q, K, K)]


def test_a_querys_attention_bits_depend_on_it_and_the_keys_only(monkeypatch):
    _elementwise_sfu(monkeypatch)
    q, k, v = _qkv(70, 45)  # a ragged key block of 13 (BLOCK_N 32)
    scale = 1 / math.sqrt(32)
    o, o_ref, (lse,) = attention.forward(q, k, v, scale, torch.bfloat16)
    rows = torch.tensor([0, 33, 69])
    o2, o_ref2, (lse2,) = attention.forward(q[rows], k, v, scale, torch.bfloat16)
    assert_bitwise(o2, o[rows])
    assert_bitwise(o_ref2, o_ref[rows])
    assert_bitwise(lse2, lse[:, rows])
    do = _qkv(70, 1)[0]
    delta = attention.delta(do, o_ref)
    dq = attention.bwd_q(q, do, (lse,), delta, k, v, scale)
    dq2 = attention.bwd_q(q[rows], do[rows], (lse[:, rows],), delta[:, rows], k, v, scale)
    assert_bitwise(dq2, dq[rows])


def _dq_case(dh: int, K: int):
    q, k, v = _qkv(70, K, dh)
    do = values(Stream(22), (70, 2, dh), -3, 1, torch.bfloat16)
    scale = 1 / math.sqrt(dh)
    _, o_ref, stats = attention.forward(q, k, v, scale, torch.bfloat16)
    return q, do, stats, attention.delta(do, o_ref), k, v, scale


def test_the_gluon_dq_model_is_row_local(monkeypatch):
    """Head dim 128 (the Gluon kernel's dq: per 128-key block partials, added in order): a query's dq
    bits depend on it and the keys alone."""
    _elementwise_sfu(monkeypatch)
    q, do, stats, delta, k, v, scale = _dq_case(128, 300)  # key blocks of 128, 128 and a ragged 44
    dq = attention.bwd_q(q, do, stats, delta, k, v, scale)
    rows = torch.tensor([0, 33, 69])
    part = attention.bwd_q(q[rows], do[rows], (stats[0][:, rows],), delta[:, rows], k, v, scale)
    assert_bitwise(part, dq[rows])


@pytest.mark.parametrize("dh", [32, 128])
def test_the_dq_models_give_the_gradient(dh):
    """Both dq models (one chain at head dim 32, per-key-block partials at 128) against float64
    autograd, within what a bf16 dS leaves (its rounding, 2^-9 relative per element, gives ~2e-3 here:
    5e-3 relative; a dropped or doubled key block would be off by far more)."""
    q, do, stats, delta, k, v, scale = _dq_case(dh, 300)
    dq = attention.bwd_q(q, do, stats, delta, k, v, scale)
    q64 = q.double().requires_grad_()
    s = torch.einsum("qhd,khd->hqk", q64, k.double()) * scale
    (want,) = torch.autograd.grad(torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double()), q64, do.double())
    assert float((dq.double() - want).norm() / want.norm()) < 5e-3


def test_a_keys_gradient_bits_depend_on_it_and_the_queries_only(monkeypatch):
    _elementwise_sfu(monkeypatch)
    q, k, v = _qkv(45, 70)  # a ragged query block of 13 (BLOCK_M 32)
    do = _qkv(45, 1)[0]
    scale = 1 / math.sqrt(32)
    _, o_ref, stats = attention.forward(q, k, v, scale, torch.bfloat16)
    delta = attention.delta(do, o_ref)
    dk, dv = attention.bwd_kv(q, do, stats, delta, k, v, scale)
    keys = torch.tensor([1, 40, 69])
    dk2, dv2 = attention.bwd_kv(q, do, stats, delta, k[keys], v[keys], scale)
    assert_bitwise(dk2, dk[keys])
    assert_bitwise(dv2, dv[keys])


def test_get_backend_builds_it_on_a_cpu_only():
    assert get_backend("emulate-sm90", "cpu").name == "emulate-sm90"
    with pytest.raises(ValueError, match="runs on a CPU"):
        get_backend("emulate-sm90", "cuda")
    with pytest.raises(ValueError, match="allowed on cpu: torch, emulate-sm90"):
        get_backend("triton", "cpu")


def test_a_run_on_cuda_with_the_emulator_is_refused_before_it_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="runs on a CPU"):
        Problem(synthetic="tiny", device="cuda", backend="emulate-sm90")
    assert Problem(synthetic="tiny", backend="emulate-sm90").block_backend == "emulate-sm90"


def test_a_retiled_kernel_is_refused_not_emulated_with_its_old_arithmetic(monkeypatch):
    from h3lab.emulate import tiles

    pinned = tiles.configs.pinned
    monkeypatch.setattr(tiles.configs, "pinned", lambda k, n: pinned(k, n) | ({"BLOCK_K": 32} if k == "gemm" else {}))
    a = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"BLOCK_K=32; allowed .*BLOCK_K=64"):
        EmulateSM90Backend().mm(a, a.t())
