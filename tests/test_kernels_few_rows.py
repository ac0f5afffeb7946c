"""The AdaLN projection's few-row kernels (h3lab.triton.few_rows): d temb's unit tree and dW adaln.

Without CUDA they run under the Triton interpreter in FP32 (its bf16 cast truncates, see
tests/test_kernels_gemm.py); with CUDA the `gpu` tests run them at the real H3 shapes:
pytest -m gpu tests/test_kernels_few_rows.py

Why the interpreter's bits are the same on every CPU: d temb's tl.dot is tests/conftest.py's
chain_dot (one FP32 chain from the accumulator, k ascending, numpy elementwise ops, not the host's
BLAS), so its unit partials are the torch chains and the tree is TorchBackend's, bit for bit;
mm_few_k is elementwise FP32 multiplies and adds in the kernel itself.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the kernels are Triton kernels)")

from h3lab.backend import TorchBackend
from h3lab.ops.fixed import unit_tree
from h3lab.triton import configs, few_rows, gemm, unit_gemm
from h3lab.triton.backend import TritonBackend
from tests.conftest import assert_bitwise, gpu_kernels

# tl.dot under the interpreter: our FP32 chain, not the host BLAS (tests/conftest.py chain_dot)
pytestmark = pytest.mark.usefixtures("chain_dot")

NODE = "sm90"
F32, BF16 = torch.float32, torch.bfloat16
interp = pytest.mark.skipif(not configs.interpreting(), reason="interpreter tests: TRITON_INTERPRET=1")


gpu = gpu_kernels(__file__)


def _randn(*shape: int, seed: int, device: str = "cpu", dtype: torch.dtype = F32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _groupings(a: torch.Tensor, b: torch.Tensor, node: str | None) -> dict[int, torch.Tensor]:
    """TP 1, 2, 4, 8: each rank's subtree over its units' slices, then the tree over the ranks."""
    kp = a.shape[1] // 8
    out = {}
    for tp in (1, 2, 4, 8):
        per = 8 // tp
        roots = [
            few_rows.unit_mm_few_rows(
                a[:, r * per * kp : (r + 1) * per * kp], b[r * per * kp : (r + 1) * per * kp], per, node=node
            )
            for r in range(tp)
        ]
        out[tp] = unit_tree(roots)
    return out


def _assert_fp32_close(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # any order of K rounded FP32 products and adds is within (K+1) 2^-24 sum|a||b| of the exact
    # sum per element (plus the tree's 3 adds); we allow twice (K + 4) 2^-24
    exact, mag = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    err = (out.double() - exact).abs()
    bound = 2 * (a.shape[1] + 4) * 2.0**-24 * mag
    assert bool((err <= bound).all()), f"{what}: max err {float(err.max()):.3g}"


# ---- interpreter -----------------------------------------------------------------------------------


@interp
def test_unit_mm_few_rows_groupings_bitwise_and_close_to_fp64():
    a, b = _randn(3, 8 * 40, seed=1), _randn(8 * 40, 70, seed=2)  # 40: a unit's last chunk is masked
    roots = _groupings(a, b, NODE)
    for tp, root in roots.items():
        assert_bitwise(root, roots[1], f"TP{tp}")
    assert_bitwise(few_rows.unit_mm_few_rows(a, b, 8, node=NODE), roots[1], "repeat")
    assert_bitwise(roots[1], TorchBackend().unit_reduce_few_rows(a, b, 8), "the torch chains' tree")
    _assert_fp32_close(roots[1], a, b, "d temb")


@interp
@pytest.mark.parametrize("b_dtype", [F32, BF16])
def test_mm_few_k_is_the_torch_chain(b_dtype):
    """Rounded products added k ascending with no FMA: exactly TorchBackend.mm's chain."""
    a, b = _randn(3, 150, seed=3), _randn(3, 70, seed=4, dtype=b_dtype)
    got = few_rows.mm_few_k(a, b, node=NODE)
    assert_bitwise(got, TorchBackend().mm_few_k(a, b), "few k")
    assert_bitwise(few_rows.mm_few_k(a[:, 7:90], b[:, 3:9], node=NODE), got[7:90, 3:9], "rows and columns")
    assert_bitwise(few_rows.mm_few_k(a[:0], b[:0], node=NODE), torch.zeros(150, 70), "K = 0: the empty chain")


@interp
def test_few_rows_reject_bad_inputs(tmp_path, monkeypatch):
    a, b = _randn(3, 80, seed=5), _randn(80, 8, seed=6)
    with pytest.raises(ValueError, match=r"num_units=3; allowed: \[1, 2, 4, 8\]"):
        few_rows.unit_mm_few_rows(a, b, 3, node=NODE)
    with pytest.raises(ValueError, match=r"17 rows; allowed: at most 16"):
        few_rows.unit_mm_few_rows(_randn(17, 80, seed=7), b, 8, node=NODE)
    with pytest.raises(ValueError, match=r"a multiple of num_units=8"):
        few_rows.unit_mm_few_rows(a[:, :76], b[:76], 8, node=NODE)
    with pytest.raises(ValueError, match=r"K=17; allowed: at most 16"):
        few_rows.mm_few_k(_randn(17, 4, seed=8), _randn(17, 4, seed=9), node=NODE)
    with pytest.raises(ValueError, match=r"a_KM is torch.int64"):
        few_rows.mm_few_k(torch.ones(2, 3, dtype=torch.int64), b[:2], node=NODE)
    with pytest.raises(ValueError, match=r"out_dtype torch.float16"):
        few_rows.mm_few_k(a[:, :4].t(), b[:4], torch.float16, node=NODE)
    (tmp_path / "sm_no_few_rows.json").write_text('{"kernels": {"norm": {}}}')  # a file without the entry
    monkeypatch.setattr(configs, "KERNELS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"sm_no_few_rows.json pins no configuration for kernel 'few_rows'"):
        few_rows.mm_few_k(a[:, :4].t(), b[:4], node="sm_no_few_rows")


# ---- GPU, real H3 shapes: T = 2 timesteps, 18 D = 96768 table columns (8 units of 12096), E = 2688 -----


@gpu
def test_gpu_unit_mm_few_rows_real_shape():
    a = _randn(2, 8 * 12096, seed=11, device="cuda")  # FP32 d table columns
    b = _randn(8 * 12096, 2688, seed=12, device="cuda", dtype=BF16)  # adaln_proj.linear.weight
    roots = _groupings(a, b, None)
    for tp, root in roots.items():
        assert_bitwise(root, roots[1], f"TP{tp}")
    assert_bitwise(few_rows.unit_mm_few_rows(a[1:2], b, 8), roots[1][1:2], "one row")
    a3 = torch.cat([a, _randn(1, 8 * 12096, seed=13, device="cuda")])
    assert_bitwise(few_rows.unit_mm_few_rows(a3, b, 8)[:2], roots[1], "three rows")
    assert_bitwise(few_rows.unit_mm_few_rows(a, b[:, 64:640], 8), roots[1][:, 64:640], "columns")
    assert_bitwise(few_rows.unit_mm_few_rows(a, b, 8), roots[1], "repeat")
    _assert_fp32_close(roots[1], a, b.float(), "d temb")


@gpu
@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_gpu_mm_few_k_is_the_torch_chain(out_dtype):
    a = _randn(2, 96768, seed=14, device="cuda")
    b = _randn(2, 2688, seed=15, device="cuda", dtype=BF16)  # silu(temb) rounded to the weights' dtype
    got = few_rows.mm_few_k(a, b, out_dtype)
    assert_bitwise(got, TorchBackend().mm_few_k(a, b, out_dtype), "dW adaln")
    assert_bitwise(few_rows.mm_few_k(a[:, 1000:5000], b[:, 100:300], out_dtype), got[1000:5000, 100:300], "slices")


@interp
def test_backend_takes_the_tiled_kernels_past_the_few_row_limit():
    """More timesteps than the pinned limit: the tiled GEMMs, chosen by T alone (the same on every rank)."""
    be = TritonBackend("cpu", node=NODE)
    b = _randn(8 * 40, 70, seed=21)
    for T in (3, 17):
        a = _randn(T, 8 * 40, seed=20)
        want = few_rows.unit_mm_few_rows(a, b, 8, node=NODE) if T <= 16 else unit_gemm.unit_mm([(a, b)], 8, node=NODE)
        assert_bitwise(be.unit_reduce_few_rows(a, b, 8), want, f"d temb, T={T}")
        k_a, k_b = _randn(T, 50, seed=22), _randn(T, 30, seed=23)
        want = few_rows.mm_few_k(k_a, k_b, node=NODE) if T <= 16 else gemm.mm(k_a.t(), k_b, node=NODE)
        assert_bitwise(be.mm_few_k(k_a, k_b), want, f"dW adaln, K={T}")
