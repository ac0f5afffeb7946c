"""The attention kernels' variants for long sequences (h3lab.triton.attention): the TMA forward, dq and
dk/dv kernels (pinned for head_dim 128 on sm90) give the bytes of the pointer kernels with the same
tile, which run the views a descriptor cannot walk; tests/test_kernels_attention.py checks the pinned
kernels' layout invariance.

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
from tests.conftest import assert_bitwise, gpu_kernels

pytestmark = pytest.mark.usefixtures("chain_dot")

interp = pytest.mark.skipif(
    not interpreting(), reason="interpreter tests: run with TRITON_INTERPRET=1 (the default without CUDA)"
)


gpu = gpu_kernels(__file__)


def _inputs(n_q: int, n_k: int, heads: int, dh: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n: torch.randn(n, heads, dh, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(n_q), mk(n_k), mk(n_k), mk(n_q)


def _check_fwd_tma(q, k, v, scale, node, cfg) -> None:
    """The forward under `cfg` (a TMA config) equals the pointer kernel with the same tile, byte for byte."""
    out_dtype = torch.bfloat16 if q.is_cuda else q.dtype
    want = att.attention_fwd(q, k, v, scale, out_dtype, node=node, config=cfg | {"TMA": False})
    got = att.attention_fwd(q, k, v, scale, out_dtype, node=node, config=cfg)
    for name, a, b in (("o", got[0], want[0]), ("o_ref", got[1], want[1]), ("lse", got[2][0], want[2][0])):
        assert_bitwise(a, b, f"TMA forward {cfg}: {name}")


def _bwd_args(q, k, v, do, scale, node) -> tuple:
    """The backward kernels' arguments on the pinned forward's statistics."""
    _, o_ref, stats = att.attention_fwd(q, k, v, scale, torch.bfloat16 if q.is_cuda else q.dtype, node=node)
    return (q, do, stats, att.attention_delta(do, o_ref, node=node), k, v, scale)


def _check_bwd_tma(q, k, v, do, scale, node, cfg_q, cfg_kv) -> None:
    """dq under `cfg_q` and dk, dv under `cfg_kv` (TMA configs) equal the pointer kernels' with the same
    tiles, byte for byte, on the pinned forward's statistics."""
    # the operands each TMA kernel walks have descriptors: the TMA kernels run, not their fallback
    assert all(att._row_desc(t, cfg_q["BLOCK_N"]) is not None for t in (k, v))
    assert all(att._row_desc(t, cfg_kv["BLOCK_M"]) is not None for t in (q, do))
    args = _bwd_args(q, k, v, do, scale, node)
    pairs = [
        (
            "dq",
            att.attention_bwd_q(*args, node=node, config=cfg_q | {"TMA": False}),
            att.attention_bwd_q(*args, node=node, config=cfg_q),
        )
    ]
    want_kv = att.attention_bwd_kv(*args, node=node, config=cfg_kv | {"TMA": False})
    got_kv = att.attention_bwd_kv(*args, node=node, config=cfg_kv)
    pairs += [("dk", want_kv[0], got_kv[0]), ("dv", want_kv[1], got_kv[1])]
    for name, want, got in pairs:
        assert_bitwise(got, want, f"TMA backward {cfg_q if name == 'dq' else cfg_kv}: {name}")


# ---- interpreter: FP32, ragged shapes ------------------------------------------------------------

FWD32 = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "TMA": True}


@interp
@pytest.mark.parametrize("n_q, n_k, heads", [(37, 61, 3), (131, 97, 2)])
def test_interp_fwd_tma_equals_pointer_kernel(n_q, n_k, heads):
    q, k, v, _ = _inputs(n_q, n_k, heads, 32, torch.float32, "cpu", seed=1)
    _check_fwd_tma(q, k, v, 32**-0.5, "sm90", FWD32)
    # a strided view of some heads (a TP rank's heads side by side): the descriptor walks it too
    _check_fwd_tma(q[:, 1:], k[:, 1:], v[:, 1:], 32**-0.5, "sm90", FWD32)


BWD_Q32 = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "TMA": True}
BWD_KV32 = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "TMA": True}
TRITON_Q128 = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "TMA": True}  # sm100's tile


@interp
@pytest.mark.parametrize("n_q, n_k, heads", [(37, 61, 3), (131, 97, 2), (64, 64, 1)])
def test_interp_bwd_tma_equals_pointer_kernels(n_q, n_k, heads):
    """Ragged query and key tails (and none: 64 x 64), whole tensors and a view of some heads."""
    q, k, v, do = _inputs(n_q, n_k, heads, 32, torch.float32, "cpu", seed=3)
    _check_bwd_tma(q, k, v, do, 32**-0.5, "sm90", BWD_Q32, BWD_KV32)
    if heads > 1:
        views = [t[:, 1:] for t in (q, k, v, do)]
        _check_bwd_tma(*views, 32**-0.5, "sm90", BWD_Q32, BWD_KV32)


@interp
def test_interp_bwd_tma_config_on_a_view_without_descriptor_gives_its_copys_bytes():
    """Heads 0 and 2 of 3 are not side by side: no descriptor, the pointer kernels run the TMA configs
    and give the bytes the TMA kernels give on a contiguous copy."""
    q, k, v, do = (t[:, ::2] for t in _inputs(70, 90, 3, 32, torch.float32, "cpu", seed=5))
    assert att._row_desc(q, BWD_KV32["BLOCK_M"]) is None and att._row_desc(k, BWD_Q32["BLOCK_N"]) is None
    got, want = (
        _bwd_args(*ts, 32**-0.5, "sm90") for ts in ((q, k, v, do), tuple(t.contiguous() for t in (q, k, v, do)))
    )
    assert_bitwise(
        att.attention_bwd_q(*got, node="sm90", config=BWD_Q32),
        att.attention_bwd_q(*want, node="sm90", config=BWD_Q32),
        "dq",
    )
    for name, a, b in zip(
        ("dk", "dv"),
        att.attention_bwd_kv(*got, node="sm90", config=BWD_KV32),
        att.attention_bwd_kv(*want, node="sm90", config=BWD_KV32),
        strict=True,
    ):
        assert_bitwise(a, b, name)


@interp
def test_interp_head_dim_128_backward_tma_kernels_give_the_pointer_bytes():
    """The pinned dk/dv tile and the Triton dq kernel's (sm90 pins dq to the Gluon kernel: its GPU
    tests), both through TMA."""
    pinned_kv = att.config_for("attention_bwd_kv", 128, "sm90")
    assert att.config_for("attention_bwd_q", 128, "sm90")["IMPL"] == "gluon" and pinned_kv["TMA"] is True
    q, k, v, do = _inputs(150, 203, 2, 128, torch.float32, "cpu", seed=4)
    _check_bwd_tma(q, k, v, do, 128**-0.5, "sm90", TRITON_Q128, pinned_kv)


@interp
def test_interp_pinned_head_dim_128_forward_is_the_tma_kernel_with_the_pointer_bytes():
    """The sm90 pin for head_dim 128 loads through descriptors and gives the pointer kernel's bytes on
    ragged shapes (2 query blocks, 2 key blocks, both partial); a view whose heads are not side by side
    (no descriptor: the pointer kernel runs it) gives the bytes of its contiguous copy (descriptors)."""
    pinned = att.config_for("attention_fwd", 128, "sm90")
    assert pinned["TMA"] is True
    q, k, v, _ = _inputs(150, 203, 3, 128, torch.float32, "cpu", seed=2)
    _check_fwd_tma(q, k, v, 128**-0.5, "sm90", pinned)
    views = [t[:, ::2] for t in (q, k, v)]  # heads 0 and 2
    strided = att.attention_fwd(*views, 128**-0.5, torch.float32, node="sm90")
    copied = att.attention_fwd(*(t.contiguous() for t in views), 128**-0.5, torch.float32, node="sm90")
    for name, a, b in (("o", strided[0], copied[0]), ("lse", strided[2][0], copied[2][0])):
        assert_bitwise(a, b, f"pinned forward, strided heads against their copy: {name}")


@interp
def test_interp_attention_configs_refuse_unknown_keys():
    q, k, v, _ = _inputs(5, 7, 1, 32, torch.float32, "cpu", seed=5)
    with pytest.raises(ValueError, match=r"attention_fwd config keys \['WARP_SPECIALIZE'\] unknown"):
        att.attention_fwd(q, k, v, 1.0, torch.float32, node="sm90", config=FWD32 | {"WARP_SPECIALIZE": True})
    _, o_ref, (lse,) = att.attention_fwd(q, k, v, 1.0, torch.float32, node="sm90")
    delta = att.attention_delta(q, o_ref, node="sm90")
    with pytest.raises(ValueError, match=r"attention_bwd_q config keys \['WARP_SPECIALIZE'\] unknown"):
        att.attention_bwd_q(q, q, (lse,), delta, k, v, 1.0, node="sm90", config=BWD_Q32 | {"WARP_SPECIALIZE": True})


# ---- GPU: bf16, head_dim 128 --------------------------------------------------------------------


def _gpu_tma_candidates() -> list[dict]:
    """The pinned head_dim 128 forward and the benchmark's TMA forwards with its key tile (a 64-key tile
    rescales its running sums at other keys: another bit class, timed but not claimed equal)."""
    from h3lab.bench.attention_long import VARIANTS

    pinned = att.config_for("attention_fwd", 128, "sm90")
    cands = [pinned, *(c for c in VARIANTS.values() if c is not None and c["TMA"])]
    return [c for c in cands if c["BLOCK_N"] == pinned["BLOCK_N"]]


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (1031, 1031, 2), (4096, 4032, 8)])
def test_gpu_fwd_tma_equals_pointer_kernel(n_q, n_k, heads):
    q, k, v, _ = _inputs(n_q, n_k, heads, 128, torch.bfloat16, "cuda", seed=6)
    for cfg in _gpu_tma_candidates():
        _check_fwd_tma(q, k, v, 128**-0.5, None, cfg)
        _check_fwd_tma(q[:, 1:], k[:, 1:], v[:, 1:], 128**-0.5, None, cfg)  # a TP rank's heads, a view


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (1031, 1031, 2), (4096, 4032, 8)])
def test_gpu_bwd_tma_equals_pointer_kernels(n_q, n_k, heads):
    q, k, v, do = _inputs(n_q, n_k, heads, 128, torch.bfloat16, "cuda", seed=7)
    cfg_q = att.config_for("attention_bwd_q", 128, "sm90")
    cfg_kv = att.config_for("attention_bwd_kv", 128, "sm90")
    _check_bwd_tma(q, k, v, do, 128**-0.5, None, cfg_q, cfg_kv)
    _check_bwd_tma(*(t[:, 1:] for t in (q, k, v, do)), 128**-0.5, None, cfg_q, cfg_kv)  # a TP rank's heads


def test_attention_variants_compile_for_sm90():
    """No GPU needed: every pinned Dh=128 attention config and every candidate of the long-sequence
    benchmark builds for sm90 with the installed Triton, within 255 registers and the 227 KiB of
    shared memory, the TMA variants with bulk tensor copies (python -m h3lab.bench.compile_sm90
    --attention prints them). A subprocess: this module may run under TRITON_INTERPRET=1, under which
    nothing compiles."""
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
        assert (v["tma_loads"] > 0) == (v["config"].get("TMA", False) or v["config"].get("IMPL") == "gluon"), v
