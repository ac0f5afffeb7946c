"""The warp-specialised Gluon attention forward (h3lab.triton.attention_fwd_sm90, Hopper only) gives
the bytes of the pinned Triton forward: o, the FP32 o_ref and lse2, on ragged query and key tails, on
a TP rank's view of some heads, call after call. Gluon has no interpreter: without an sm90 GPU only
the compile check runs (every variant builds for sm90 with the installed Triton, no spills).
    pytest -m gpu tests/test_kernels_attention_sm90.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the attention kernels are Triton kernels)")

from tests.conftest import assert_bitwise, gpu_kernels

gpu = gpu_kernels(__file__)
GLUON = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True, "IMPL": "gluon"}
CANDIDATES = {
    "ws": GLUON,
    "pingpong": GLUON | {"PINGPONG": True},
    "ws_s3": GLUON | {"GLUON_STAGES": 3},
    "pingpong_s3": GLUON | {"PINGPONG": True, "GLUON_STAGES": 3},
}


def _inputs(n_q: int, n_k: int, heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n: torch.randn(n, heads, 128, generator=g).to(device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return mk(n_q), mk(n_k), mk(n_k)


@gpu
@pytest.mark.parametrize("name", sorted(CANDIDATES))
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (1031, 1031, 2), (4096, 4032, 8), (128, 1, 1)])
def test_gpu_gluon_forward_gives_the_pinned_forwards_bytes(name, n_q, n_k, heads):
    from h3lab.triton import attention as att

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is Hopper-only (sm90)")
    q, k, v = _inputs(n_q, n_k, heads, seed=n_q + n_k)
    pinned = att.config_for("attention_fwd", 128, "sm90")
    for views in ((q, k, v), (q[:, 1:], k[:, 1:], v[:, 1:])):  # whole tensors, a TP rank's heads
        if views[0].shape[1] == 0:
            continue
        want = att.attention_fwd(*views, 128**-0.5, torch.bfloat16, config=pinned)
        for _ in range(3):  # call after call
            got = att.attention_fwd(*views, 128**-0.5, torch.bfloat16, config=CANDIDATES[name])
            for part, a, b in (("o", got[0], want[0]), ("o_ref", got[1], want[1]), ("lse", got[2][0], want[2][0])):
                assert_bitwise(a, b, f"gluon {name} forward at {n_q}x{n_k}, heads {views[0].shape[1]}: {part}")


@gpu
def test_gpu_gluon_forward_refuses_a_config_it_cannot_run():
    from h3lab.triton import attention as att

    q, k, v = _inputs(256, 256, 1, seed=1)
    with pytest.raises(ValueError, match=r"attention_fwd IMPL gluon: BLOCK_N=64; allowed: \[128\]"):
        att.attention_fwd(q, k, v, 0.1, torch.bfloat16, config=CANDIDATES["ws"] | {"BLOCK_N": 64})
    with pytest.raises(ValueError, match=r"attention_fwd IMPL gluon: GLUON_STAGES=4; allowed: \[2, 3\]"):
        att.attention_fwd(q, k, v, 0.1, torch.bfloat16, config=CANDIDATES["ws"] | {"GLUON_STAGES": 4})


COMPILE = """
from h3lab.bench.compile_pinned import build
from h3lab.triton.attention_fwd_sm90 import variant
for pingpong in (False, True):
    for stages in (2, 3):
        ptx = build(variant(pingpong, stages), "sm90").asm["ptx"]
        assert "ld.local" not in ptx and "st.local" not in ptx, f"pingpong={pingpong}: register spills"
        assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx, f"pingpong={pingpong}: no wgmma or register moves"
        print("ok", pingpong, stages)
"""


def test_gluon_forward_variants_compile_for_sm90():
    """No GPU needed: both variants build for sm90 with the installed Triton, fit shared memory and
    spill nothing. In a subprocess without TRITON_INTERPRET (Gluon cannot compile interpreted helpers)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("ok") == 4, done.stdout
