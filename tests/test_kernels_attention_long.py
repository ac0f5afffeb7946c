"""The attention variants for long sequences (h3lab.triton.attention): the TMA forward and the fused
backward give the bytes of the pinned pointer forward and of the split backward (attention_bwd_q +
attention_bwd_kv), whose layout invariance tests/test_kernels_attention.py checks.

Without CUDA the kernels run under the Triton interpreter in FP32 (tl.dot as tests/conftest.py's
chain_dot, so equal chains give equal bits on every CPU); with CUDA the `gpu` tests run the compiled
bf16 kernels at head_dim 128, in their own process:
    pytest -m gpu tests/test_kernels_attention_long.py
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the attention kernels are Triton kernels)")

from h3lab.triton import attention as att
from h3lab.triton.configs import interpreting
from tests.conftest import assert_bitwise

pytestmark = pytest.mark.usefixtures("chain_dot")

interp = pytest.mark.skipif(
    not interpreting(), reason="interpreter tests: run with TRITON_INTERPRET=1 (the default without CUDA)"
)


def gpu(fn):
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)
    fn = pytest.mark.skipif(
        interpreting(),
        reason="TRITON_INTERPRET=1 in this process; run: pytest -m gpu tests/test_kernels_attention_long.py",
    )(fn)
    return pytest.mark.gpu(fn)


def _inputs(n_q: int, n_k: int, heads: int, dh: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n: torch.randn(n, heads, dh, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(n_q), mk(n_k), mk(n_k), mk(n_q)


def _stats(q, k, v, do, scale, node):
    _, o_ref, (lse,) = att.attention_fwd(q, k, v, scale, q.dtype, node=node)
    return lse, att.attention_delta(do, o_ref, node=node)


def _split(q, do, lse, delta, k, v, scale, node):
    dq = att.attention_bwd_q(q, do, (lse,), delta, k, v, scale, node=node)
    return (dq, *att.attention_bwd_kv(q, do, (lse,), delta, k, v, scale, node=node))


def _check_fwd_tma(q, k, v, scale, node, cfg) -> None:
    want = att.attention_fwd(q, k, v, scale, torch.bfloat16 if q.is_cuda else q.dtype, node=node)
    got = att.attention_fwd(q, k, v, scale, want[0].dtype, node=node, config=cfg)
    for name, a, b in (("o", got[0], want[0]), ("o_ref", got[1], want[1]), ("lse", got[2][0], want[2][0])):
        assert_bitwise(a, b, f"TMA forward {cfg}: {name}")


def _check_fused(q, k, v, do, scale, node, cfg) -> tuple:
    lse, delta = _stats(q, k, v, do, scale, node)
    want = _split(q, do, lse, delta, k, v, scale, node)
    got = att.attention_bwd(q, do, (lse,), delta, k, v, scale, node=node, config=cfg)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_bitwise(a, b, f"fused backward {cfg}: {name}")
    return got, lse, delta


# ---- interpreter: FP32, ragged shapes ------------------------------------------------------------

FWD32 = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "TMA": True}
FUSED32 = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "HEAD_GROUP": 2, "CHUNK": 2}


@interp
@pytest.mark.parametrize("n_q, n_k, heads", [(37, 61, 3), (131, 97, 2)])
def test_interp_fwd_tma_equals_pointer_kernel(n_q, n_k, heads):
    q, k, v, _ = _inputs(n_q, n_k, heads, 32, torch.float32, "cpu", seed=1)
    _check_fwd_tma(q, k, v, 32**-0.5, "sm90", FWD32)
    # a strided view of some heads (a TP rank's heads side by side): the descriptor walks it too
    _check_fwd_tma(q[:, 1:], k[:, 1:], v[:, 1:], 32**-0.5, "sm90", FWD32)


@interp
@pytest.mark.parametrize(
    "n_q, n_k, heads, cfg",
    [
        (131, 200, 3, FUSED32),  # 5 query blocks (ragged), 4 key blocks (ragged), head groups of 2 and 1
        (96, 128, 2, FUSED32 | {"CHUNK": 3, "HEAD_GROUP": 1}),  # no ragged tail; a turn every 3 blocks
        (37, 61, 3, FUSED32 | {"HEAD_GROUP": 8}),  # one key block, one query block (no turns to wait)
    ],
)
def test_interp_fused_backward_equals_split(n_q, n_k, heads, cfg):
    q, k, v, do = _inputs(n_q, n_k, heads, 32, torch.float32, "cpu", seed=2)
    _check_fused(q, k, v, do, 0.17, "sm90", cfg)


@interp
def test_interp_fused_backward_head_dim_128_pinned_tiles():
    q, k, v, do = _inputs(150, 203, 2, 128, torch.float32, "cpu", seed=3)
    _check_fused(q, k, v, do, 128**-0.5, "sm90", None)  # the pinned 64 x 128 tile: 3 query, 2 key blocks


@interp
def test_interp_fused_backward_rows_depend_on_their_row_and_the_whole_other_set():
    """The contract under a query or key split: the fused call's dq rows equal the split dq kernel on
    a slice of the queries (every key), its dk/dv rows the split dk/dv kernel on a slice of the keys."""
    q, k, v, do = _inputs(131, 200, 2, 32, torch.float32, "cpu", seed=4)
    scale = 32**-0.5
    (dq, dk, dv), lse, delta = _check_fused(q, k, v, do, scale, "sm90", FUSED32)
    lo, hi = 33, 100
    part = att.attention_bwd_q(q[lo:hi], do[lo:hi], (lse[:, lo:hi],), delta[:, lo:hi], k, v, scale, node="sm90")
    assert_bitwise(part, dq[lo:hi], "dq of query rows 33:100")
    dk_p, dv_p = att.attention_bwd_kv(q, do, (lse,), delta, k[lo:hi], v[lo:hi], scale, node="sm90")
    assert_bitwise(dk_p, dk[lo:hi], "dk of key rows 33:100")
    assert_bitwise(dv_p, dv[lo:hi], "dv of key rows 33:100")


@interp
def test_interp_attention_configs_refuse_unknown_keys():
    q, k, v, do = _inputs(5, 7, 1, 32, torch.float32, "cpu", seed=5)
    with pytest.raises(ValueError, match=r"attention_fwd config keys \['WARP_SPECIALIZE'\] unknown"):
        att.attention_fwd(q, k, v, 1.0, torch.float32, node="sm90", config=FWD32 | {"WARP_SPECIALIZE": True})
    lse, delta = _stats(q, k, v, do, 1.0, "sm90")
    with pytest.raises(ValueError, match=r"attention_bwd_fused config keys \['TMA'\] unknown"):
        att.attention_bwd(q, do, (lse,), delta, k, v, 1.0, node="sm90", config=FUSED32 | {"TMA": True})


# ---- GPU: bf16, head_dim 128 --------------------------------------------------------------------


def _gpu_candidates(kind: str) -> list[dict]:
    """The benchmark's candidates; forwards only with the pinned key tile (a 64-key tile rescales its
    running sums at other keys: another bit class, timed but not claimed equal)."""
    from h3lab.bench.attention_long import VARIANTS

    index = 0 if kind == "fwd" else 1
    cands = [v[index] for v in VARIANTS.values() if isinstance(v[index], dict)]
    if kind == "fwd":
        keys = att.config_for("attention_fwd", 128, "sm90")["BLOCK_N"]
        cands = [c for c in cands if c["BLOCK_N"] == keys]
    return cands


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (1031, 1031, 2), (4096, 4032, 8)])
def test_gpu_fwd_tma_candidates_equal_pinned(n_q, n_k, heads):
    q, k, v, _ = _inputs(n_q, n_k, heads, 128, torch.bfloat16, "cuda", seed=6)
    for cfg in _gpu_candidates("fwd"):
        _check_fwd_tma(q, k, v, 128**-0.5, None, cfg)


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (1031, 1031, 2), (4096, 4032, 16)])
def test_gpu_fused_backward_candidates_equal_split(n_q, n_k, heads):
    """Also a race check: the turns' ordering is what makes dq the split kernel's chain, so a missing
    acquire/release shows as bytes that differ from the split kernels' (or between two calls)."""
    q, k, v, do = _inputs(n_q, n_k, heads, 128, torch.bfloat16, "cuda", seed=7)
    for cfg in [None, *_gpu_candidates("bwd")]:
        got, lse, delta = _check_fused(q, k, v, do, 128**-0.5, None, cfg)
        again = att.attention_bwd(q, do, (lse,), delta, k, v, 128**-0.5, config=cfg)
        for name, a, b in zip(("dq", "dk", "dv"), again, got, strict=True):
            assert_bitwise(a, b, f"fused backward {cfg} repeated: {name}")


def test_attention_variants_compile_for_sm90():
    """No GPU needed: every pinned Dh=128 attention config and every candidate of the long-sequence
    benchmark builds for sm90 with the installed Triton, within 255 registers and the 227 KiB of
    shared memory, the TMA variants with bulk tensor copies. Spills are reported, not refused: the
    fused backward keeps dk, dv (128 registers) and a dq slice live and spills 100-300 bytes
    (python -m h3lab.bench.compile_sm90 --attention prints them). A subprocess: this module may run
    under TRITON_INTERPRET=1, under which nothing compiles."""
    import json
    import subprocess
    import sys

    from h3lab.bench import compile_sm90

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "h3lab.bench.compile_sm90", "--attention", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    variants = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(variants) == len(compile_sm90.attention_variants())
    for v in variants:
        assert v["registers"] <= 255 and v["shared_bytes"] <= compile_sm90.SM90_SHARED_BYTES, v
        assert v["wgmma"] > 0, v
        uses_tma = v["config"].get("TMA", False) or v["kernel"] == "attention_bwd_fused"
        assert (v["tma_loads"] > 0) == uses_tma, v
