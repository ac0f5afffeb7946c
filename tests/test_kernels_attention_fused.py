"""The fused attention backward candidate (h3lab.triton.attention_fused): dk, dv are the pinned dk/dv
kernel's bytes with the same tile; dq is summed in key-block order, so its bits differ from the
split kernels' but keep the contract: a query row's dq does not depend on the other query rows in
the call. Interpreter (FP32, tl.dot as conftest's chain_dot) on CPU; `-m gpu` on a GPU:
    pytest -m gpu tests/test_kernels_attention_fused.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the attention kernels are Triton kernels)")

from h3lab.bench.attention_fused_bwd import BENCH_FORMAT
from h3lab.bench.attention_fused_bwd import main as bench_main
from h3lab.triton import attention as att
from h3lab.triton.attention_fused import attention_bwd_fused
from h3lab.triton.configs import interpreting
from h3lab.workbench.benchmarks import table
from tests.conftest import assert_bitwise, gpu_kernels

pytestmark = pytest.mark.usefixtures("chain_dot")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests: run with TRITON_INTERPRET=1")
gpu = gpu_kernels(__file__)
KV32 = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
KV128 = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}


def _case(n_q: int, n_k: int, heads: int, dh: int, device: str, seed: int):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(n, heads, dh, generator=g).to(device, dtype) for n in (n_q, n_k, n_k, n_q))
    scale = dh**-0.5
    node = "sm90" if device == "cpu" else None
    _, o_ref, stats = att.attention_fwd(q, k, v, scale, dtype if device == "cpu" else torch.bfloat16, node=node)
    delta = att.attention_delta(do, o_ref, node=node)
    return (q, do, stats, delta, k, v, scale), node


def _check(args, node, cfg) -> None:
    q, do, stats, delta, k, v, scale = args
    dq, dk, dv = attention_bwd_fused(*args, config=cfg)
    keys_first = attention_bwd_fused(*args, config=cfg, order="keys_first")
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), keys_first, strict=True):
        assert_bitwise(a, b, f"fused {name}: heads first against keys first (the launch order moves no bit)")
    want_dk, want_dv = att.attention_bwd_kv(*args, node=node, config=cfg)
    assert_bitwise(dk, want_dk, "fused dk against the dk/dv kernel")
    assert_bitwise(dv, want_dv, "fused dv against the dk/dv kernel")
    want_dq = att.attention_bwd_q(*args, node=node)
    gap = float((dq.double() - want_dq.double()).norm() / want_dq.double().norm())
    # the same bf16 dS and K, summed in another order (key-block partials added, against one chained
    # accumulator): FP32 rounding apart; the GPU's tensor cores accumulate with less than FP32's
    # rounding, so a looser bound there, still far under bf16's 2^-8
    assert gap < (1e-5 if q.dtype == torch.float32 else 1e-3), gap
    # the rows of a query slice, with their statistics: the same dq bytes (row-local, any split)
    a, b = q.shape[0] // 3, q.shape[0] - 5
    part = (q[a:b], do[a:b], (stats[0][:, a:b],), delta[:, a:b], k, v, scale)
    assert_bitwise(attention_bwd_fused(*part, config=cfg)[0], dq[a:b], "fused dq of a query slice")


@interp
@pytest.mark.parametrize("n_q, n_k, heads", [(101, 150, 2), (64, 64, 1), (37, 200, 3)])
def test_interp_fused_backward(n_q, n_k, heads):
    args, node = _case(n_q, n_k, heads, 32, "cpu", seed=n_q)
    _check(args, node, KV32)


@interp
def test_interp_fused_diagnostics_add_the_same_partials():
    """The interpreter runs one program at a time, a head's key blocks in order: without turns the
    adds still come in key-block order, so "unordered" gives the kernel's bytes here (not on a GPU);
    "skipped" leaves dq zero and dk, dv as they are."""
    args, _ = _case(101, 150, 2, 32, "cpu", seed=3)
    want = attention_bwd_fused(*args, config=KV32)
    unordered = attention_bwd_fused(*args, config=KV32, dq_mode="unordered")
    for name, a, b in zip(("dq", "dk", "dv"), want, unordered, strict=True):
        assert_bitwise(a, b, f"unordered {name} in the interpreter's program order")
    dq, dk, dv = attention_bwd_fused(*args, config=KV32, dq_mode="skipped")
    assert not dq.any() and want[0].abs().sum() > 0
    assert_bitwise(dk, want[1], "dk without dq")
    assert_bitwise(dv, want[2], "dv without dq")


@interp
def test_interp_fused_backward_refuses_what_it_cannot_run():
    args, _ = _case(40, 50, 3, 32, "cpu", seed=1)
    with pytest.raises(ValueError, match=r"keys \['TMA'\] wrong; needs exactly \['BLOCK_M', 'BLOCK_N', 'num_stages'"):
        attention_bwd_fused(*args, config=KV32 | {"TMA": True})
    with pytest.raises(ValueError, match=r"order 'heads'; allowed: \['heads_first', 'keys_first'\]"):
        attention_bwd_fused(*args, config=KV32, order="heads")
    with pytest.raises(ValueError, match=r"dq_mode 'any'; allowed: \['ordered', 'unordered', 'skipped'\]"):
        attention_bwd_fused(*args, config=KV32, dq_mode="any")
    with pytest.raises(ValueError, match=r"keys \['num_stages'\] wrong"):
        attention_bwd_fused(*args, config={k: v for k, v in KV32.items() if k != "num_stages"})
    q, do, stats, delta, k, v, scale = args
    views = (q[:, ::2], do[:, ::2], (stats[0][::2],), delta[::2], k[:, ::2], v[:, ::2], scale)
    with pytest.raises(ValueError, match=r"loads q and dO through TMA: q \(40, 2, 32\) strides .*; allowed: Q > 0"):
        attention_bwd_fused(*views, config=KV32)


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (4096, 4032, 8)])
def test_gpu_fused_backward(n_q, n_k, heads):
    args, node = _case(n_q, n_k, heads, 128, "cuda", seed=n_q)
    _check(args, node, KV128)


def test_the_table_reads_both_record_formats():
    """A v1 record timed the keys-first order only, as "fused"; v2 times both orders; v3 adds the
    diagnostics; v4 the Gluon candidate's other order and diagnostics."""
    one = {"split_ms": 10.0, "fused_ms": 23.0, "fused_over_split": 2.3, "bitwise_vs_split": {"dk": True, "dv": True}}
    v1 = table("attention_fused", {"format": "h3lab-bench-attention-fused-bwd-v1", "rows": {"16384": one}})
    assert v1.loc[16384, "keys-first ms"] == 23.0 and pd.isna(v1.loc[16384, "heads-first ms"])
    two = one | {"fused_ms": 9.0, "fused_over_split": 0.9, "keys_first_ms": 23.0, "keys_first_over_split": 2.3}
    v2_format = "h3lab-bench-attention-fused-bwd-v2"
    v2 = table("attention_fused", {"format": v2_format, "rows": {"16384": two | {"orders_bitwise": True}}})
    assert v2.loc[16384, ["heads-first ms", "keys-first ms"]].tolist() == [9.0, 23.0]
    assert v2.loc[16384, "orders bitwise"] and v2.loc[16384, "dk, dv bitwise"]
    assert pd.isna(v2.loc[16384, "no dq / split"])
    three = two | {"unordered_over_split": 1.5, "unordered_keys_first_over_split": 1.4, "no_dq_over_split": 0.7}
    v3 = table("attention_fused", {"format": BENCH_FORMAT, "rows": {"16384": three}})
    got = v3.loc[16384, ["unordered / split", "unordered keys-first / split", "no dq / split"]].tolist()
    assert got == [1.5, 1.4, 0.7]
    assert pd.isna(v3.loc[16384, "gluon heads-first / split"])
    four = three | {"gluon_over_split": 1.0, "gluon_heads_first_over_split": 1.7, "gluon_no_dq_over_split": 1.05}
    v4 = table(
        "attention_fused", {"format": BENCH_FORMAT, "rows": {"16384": four | {"gluon_unordered_over_split": 1.1}}}
    )
    gluon = ["gluon / split", "gluon heads-first / split", "gluon unordered / split", "gluon no dq adds / split"]
    assert v4.loc[16384, gluon].tolist() == [1.0, 1.7, 1.1, 1.05] and v4.loc[16384, "gluon bitwise"] is None
    bits = {"dq_vs_fused": True, "dk_vs_split": True, "dv_vs_split": True, "orders_bitwise": True, "calls": 200}
    ran = {
        "16384": four | {"gluon": bits | {"repeat_bitwise": True}},
        "32768": four | {"gluon": bits | {"repeat_bitwise": False}},
    }
    v4 = table("attention_fused", {"format": BENCH_FORMAT, "rows": ran})
    assert v4["gluon bitwise"].tolist() == [True, False]


def test_the_bench_refuses_fewer_than_two_repeats(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_main(["--out", str(tmp_path / "f.json"), "--repeats", "1"])
    assert stop.value.code == 2 and "--repeats 1; allowed: >= 2" in capsys.readouterr().err
    assert not (tmp_path / "f.json").exists()


COMPILE_SM90 = """
import re
from h3lab.bench.compile_pinned import build
from h3lab.triton.attention_fused_sm90 import variant
k = build(variant(), "sm90")
ptx = k.asm["ptx"]
print("shared", k.metadata.shared)
print("ptx", ptx)
"""


def test_gluon_fused_backward_compiles_for_sm90_with_its_ordering_instructions():
    """No GPU needed: the Gluon candidate (h3lab.triton.attention_fused_sm90) builds for sm90 with the
    installed Triton, fits shared memory, adds dq by TMA reduce, acquires turns by ld.acquire and
    releases each only after a bulk wait that covers the adds' global writes (the last bulk wait
    before every release has no `.read`). In a subprocess without TRITON_INTERPRET (Gluon cannot
    compile interpreted helpers)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SM90], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    shared = int(re.search(r"^shared (\d+)$", done.stdout, re.M).group(1))
    ptx = done.stdout.split("ptx ", 1)[1]
    assert shared <= 232_448, shared  # sm90's shared memory per block
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", ptx)
    waits = [(m.start(), m.group(1)) for m in re.finditer(r"cp\.async\.bulk\.wait_group(\.read)? \d;", ptx)]
    releases = [m.start() for m in re.finditer(r"st\.release\.gpu\.global\.b32", ptx)]
    assert releases and "atom.global.gpu.release" not in ptx
    for at in releases:
        before = [kind for pos, kind in waits if pos < at]
        assert before and before[-1] is None, f"the bulk wait before the release at {at} is {before[-1:]}"
    assert "ld.global.acquire.gpu.b32" in ptx and ptx.count("wgmma.mma_async") >= 5


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (4096, 4032, 8)])
def test_gpu_gluon_fused_backward_gives_the_candidates_bytes(n_q, n_k, heads):
    """dk, dv: the pinned dk/dv kernel's bytes (KV128); dq: the Triton candidate's (the same adds in
    the same key-block order, here TMA reduce-adds), under both launch orders; 20 calls give one set
    of bytes."""
    from h3lab.triton.attention_fused_sm90 import attention_bwd_fused_sm90

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon candidate is Hopper-only (sm90)")
    args, node = _case(n_q, n_k, heads, 128, "cuda", seed=n_q)
    got = attention_bwd_fused_sm90(*args)
    want_dk, want_dv = att.attention_bwd_kv(*args, node=node, config=KV128)
    assert_bitwise(got[1], want_dk, "Gluon fused dk against the dk/dv kernel")
    assert_bitwise(got[2], want_dv, "Gluon fused dv against the dk/dv kernel")
    assert_bitwise(got[0], attention_bwd_fused(*args, config=KV128)[0], "Gluon fused dq against the candidate's")
    for name, a, b in zip(("dq", "dk", "dv"), got, attention_bwd_fused_sm90(*args, order="heads_first"), strict=True):
        assert_bitwise(a, b, f"Gluon fused {name}, keys_first against heads_first")
    for _ in range(20):
        for name, a, b in zip(("dq", "dk", "dv"), got, attention_bwd_fused_sm90(*args), strict=True):
            assert_bitwise(a, b, f"Gluon fused {name}, call to call")


@gpu
@pytest.mark.parametrize("n_q, n_k, heads", [(517, 389, 3), (4096, 4032, 8)])
def test_gpu_pinned_dq_is_the_fused_kernels_for_any_query_set(n_q, n_k, heads):
    """kernels/sm90.json pins dq at Dh 128 to the Gluon kernel without dk and dv: attention_bwd_q gives
    the fused attention_bwd's dq bytes, for a slice of the queries too (a CP rank's), and the fused
    dk, dv are attention_bwd_kv's: the block's fused call (no CP) and its two calls (CP) agree."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the pinned Gluon dq is Hopper-only (sm90)")
    args, _ = _case(n_q, n_k, heads, 128, "cuda", seed=n_q + 1)
    dq, dk, dv = att.attention_bwd(*args)
    assert_bitwise(att.attention_bwd_q(*args), dq, "pinned dq against the fused call's")
    want_dk, want_dv = att.attention_bwd_kv(*args)
    assert_bitwise(dk, want_dk, "fused dk against the pinned dk/dv kernel")
    assert_bitwise(dv, want_dv, "fused dv against the pinned dk/dv kernel")
    q, do, stats, delta, k, v, scale = args
    a, b = n_q // 3, n_q - 5
    part = (q[a:b], do[a:b], (stats[0][:, a:b],), delta[:, a:b], k, v, scale)
    assert_bitwise(att.attention_bwd_q(*part), dq[a:b], "pinned dq of a query slice")


@interp
def test_interp_pinned_gluon_dq_refuses_the_interpreter():
    """No other kernel has the Gluon dq's bits, so where it cannot run the launcher raises (never the
    Triton dq kernel's other order instead)."""
    args, _ = _case(40, 50, 2, 128, "cpu", seed=2)
    with pytest.raises(ValueError, match=r"attention_bwd_q IMPL gluon on cpu; allowed: a compiled run on an sm90"):
        att.attention_bwd_q(*args, node="sm90")
    with pytest.raises(ValueError, match=r"attention_bwd_q IMPL gluon on cpu"):
        att.attention_bwd(*args, node="sm90")
