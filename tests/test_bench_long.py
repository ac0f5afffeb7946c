"""The long-sequence benchmarks' CPU side: the FP64 references they measure against, and their arguments.

Tolerances: the chunked and the plain float64 attention compute the same function in another
summation order (query chunks; the softmax and every product the same), so they differ by a few
roundoffs of float64 (1.1e-16): we see <= 9e-16 relative, so 1e-12 leaves ~10^3 of headroom and
fails by ~10^4 for any float32 rounding (6e-8).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports the kernels (attention_long does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from h3lab.batch import packed_batch
from h3lab.bench import attention_long, block_gpu
from h3lab.config import H3Config
from h3lab.metrics import error_stats
from h3lab.reference.oracle import chunked_attention, oracle_block
from h3lab.weights import synthetic_block

RTOL_FP64 = 1e-12


@pytest.mark.parametrize("score_bytes", [1, 3000, 10**6])  # one row per chunk, ragged chunks, one chunk
def test_chunked_oracle_equals_dense_oracle(score_bytes):
    c = H3Config.tiny()
    w = synthetic_block(c, 0, seed=3)
    b = packed_batch(c, 61, seed=4, padding=5)  # padding rows: masked keys inside every chunk
    dense, chunked = oracle_block(w, b).tensors(), oracle_block(w, b, score_bytes=score_bytes).tensors()
    assert dense.keys() == chunked.keys()
    for name in dense:
        assert chunked[name].dtype == torch.float64
        err = error_stats(chunked[name], dense[name])["rel_l2"]
        assert err <= RTOL_FP64, (name, err)


def test_chunked_attention_refuses_no_bytes():
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="score_bytes=0"):
        chunked_attention(q, q, q, torch.ones(3, dtype=torch.bool), 0)


def test_attention_long_reference_equals_autograd_fp64():
    """The benchmark's float64 reference (o, lse2, dq on some query rows, dk/dv on some key rows, in
    chunks of 64 rows) against float64 autograd on the whole problem."""
    g = torch.Generator().manual_seed(5)
    heads, n_q, n_k = 2, 150, 131
    x = {n: torch.randn(r, heads, attention_long.DH, generator=g) for n, r in (("q", n_q), ("k", n_k), ("v", n_k))}
    x["do"] = torch.randn(n_q, heads, attention_long.DH, generator=g)
    scale = attention_long.DH**-0.5
    rows, keys = torch.tensor([0, 7, 64, 65, 149]), torch.tensor([1, 2, 130])
    ref = attention_long.reference64(x, scale, rows, keys)
    q, k, v = (x[n].double().requires_grad_() for n in ("q", "k", "v"))
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    o.backward(x["do"].double())
    want = {"o": o[rows], "lse": torch.logsumexp(s, -1)[:, rows] / math.log(2), "dq": q.grad[rows]}
    want |= {"dk": k.grad[keys], "dv": v.grad[keys]}
    for name, t in want.items():
        err = float((ref[name] - t.detach()).norm() / t.detach().norm())
        assert err <= RTOL_FP64, (name, err)


def test_attention_long_variants_are_valid_configs():
    from h3lab.triton.attention import CONFIG_KEYS

    assert next(iter(attention_long.VARIANTS)) == "pinned"
    for name, fwd in attention_long.VARIANTS.items():
        assert fwd is None or set(fwd) <= CONFIG_KEYS["attention_fwd"], name
    assert attention_long.parse_rows("4096,65536") == [4096, 65536]
    for bad in ("4096,", "16k", "64"):
        with pytest.raises(ValueError, match="--rows entry"):
            attention_long.parse_rows(bad)


def test_attention_long_bound_is_the_backward_rate_that_reaches_0_9():
    """summary.bound: the split backward's TFLOP/s now, and the rate at which forward + delta + backward
    would take SDPA's forward+backward time / 0.9 (hand-made times, the arithmetic only)."""
    from h3lab.triton.attention import flops

    rows, keys, heads = 4096, 4032, 56
    kernels = {"fwd": {"ms": 1.0}, "delta": {"ms": 0.1}, "bwd_q": {"ms": 1.5}, "bwd_kv": {"ms": 2.0}}
    rec = {"rows": rows, "keys": keys, "heads": heads, "variants": {}, "kernels": kernels}
    rec["sdpa"] = {"best": "cudnn", "best_fwd": "cudnn", "cudnn": {"fwd_ms": 0.9, "fwd_bwd_ms": 3.6}}
    bound = attention_long.summarize(rec)["bound"]
    bwd = flops(rows, keys, heads, attention_long.DH)["bwd"]
    assert bound["backward"] == "split" and bound["bwd_tflops"] == pytest.approx(bwd / 3.5 / 1e9)
    assert bound["bwd_tflops_for_0.9"] == pytest.approx(bwd / (3.6 / 0.9 - 1.1) / 1e9)
    # the fused backward: its own time and its 5 products
    fused = rec | {"fused_backward": True, "kernels": kernels | {"bwd": {"ms": 2.5}}}
    bwd5 = flops(rows, keys, heads, attention_long.DH)["bwd_fused"]
    assert attention_long.summarize(fused)["bound"]["bwd_tflops"] == pytest.approx(bwd5 / 2.5 / 1e9)
    rec["sdpa"]["cudnn"]["fwd_bwd_ms"] = 0.9  # forward + delta alone are over the line: no rate reaches it
    assert attention_long.summarize(rec)["bound"]["bwd_tflops_for_0.9"] is None


def test_block_gpu_arguments():
    a = block_gpu.parse_args(["--out", "x.json", "--rows", "16384", "--no-graphs", "--reps", "3"])
    assert a.rows == [16384] and not a.graphs and a.reps == 3
    assert block_gpu.parse_args(["--out", "x.json"]).graphs
    for bad in (["--rows", "16384,"], ["--rows", "0"], ["--reps", "1"]):
        with pytest.raises(SystemExit):
            block_gpu.parse_args(["--out", "x.json", *bad])
    assert block_gpu.oracle_score_bytes(4096) is None  # the plain oracle, as every figure before
    assert block_gpu.oracle_score_bytes(16384) == block_gpu.ORACLE_SCORE_BYTES


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run of the benchmark's logic (CPU only)")
def test_attention_long_bench_rows_logic_under_the_interpreter(monkeypatch, chain_dot):
    """bench_rows end to end on a small FP32 problem in the interpreter, GPU clocks and SDPA stubbed:
    every variant runs and is close to float64; those with the pinned forward's key tile keep the
    pinned bytes (the TMA and pointer kernels compute the same chains), a 64-key forward tile rescales
    its running sums at other places, so another bit class; the summary picks one that keeps them."""
    from h3lab.triton.attention import config_for

    pinned_keys = config_for("attention_fwd", attention_long.DH, "sm100")["BLOCK_N"]
    g = torch.Generator().manual_seed(9)

    def make(rows: int, heads: int, seed: int) -> dict[str, torch.Tensor]:  # FP32: the interpreter's honest dtype
        sizes = {"q": rows, "k": rows - 3, "v": rows - 3, "do": rows}
        return {n: torch.randn(r, heads, attention_long.DH, generator=g) for n, r in sizes.items()}

    monkeypatch.setattr(attention_long, "make_inputs", make)
    # sm100's pins, the Triton kernels: sm90's dq is the Gluon kernel, which the interpreter cannot run
    monkeypatch.setattr(attention_long, "NODE", "sm100")
    monkeypatch.setattr(attention_long, "timed", lambda fn: {"ms": 1.0, "reps": 1, "spread_ms": [1.0, 1.0]})
    monkeypatch.setattr(attention_long, "peak_gib", lambda fn: 0.0)
    sdpa = {"cudnn": {"fwd_ms": 0.5, "fwd_bwd_ms": 1.5, "bwd_ms": 1.0}, "best": "cudnn", "best_fwd": "cudnn"}
    monkeypatch.setattr(attention_long, "sdpa", lambda x, scale, rows: sdpa)
    monkeypatch.setattr(attention_long, "DTYPE", torch.float32)
    saved = []
    rec = attention_long.bench_rows(200, 2, 0.1, attention_long.VARIANTS, saved.append)
    assert len(saved) == len(attention_long.VARIANTS) + 1  # each variant, then the per-kernel times
    assert set(rec["kernels"]) == {"fwd", "delta", "bwd_q", "bwd_kv", "bwd"} and not rec["fused_backward"]
    assert set(rec["summary"]["bound"]) == {"backward", "bwd_tflops", "bwd_tflops_for_0.9"}
    for name, r in rec["variants"].items():
        assert "error" not in r, (name, r)
        fwd = attention_long.VARIANTS[name]
        same_tile = fwd is None or fwd["BLOCK_N"] == pinned_keys
        assert all(r["bitwise_vs_pinned"].values()) == same_tile and r["repeat_bitwise"], name
        assert max(r["rel_l2_vs_float64"].values()) < 1e-5, (name, r["rel_l2_vs_float64"])  # FP32 chains
    assert rec["summary"]["best_same_bits"]["speed_fwd_bwd_vs_sdpa"] == pytest.approx(1.5 / 2.0)
