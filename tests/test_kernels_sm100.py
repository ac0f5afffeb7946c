"""kernels/sm100.json (the B200): every kernel sm90 pins is pinned, marked not verified, and compiles
for sm100 with the installed Triton, without a GPU (h3lab.bench.compile_pinned). What it cannot
show, bits and speed on a B200, kernels/README.md says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (the kernels are Triton kernels)")

from h3lab.bench import compile_pinned
from h3lab.triton import configs  # no Triton import: modules that interpret kernels check how it was imported

SM90 = json.loads((configs.KERNELS_DIR / "sm90.json").read_text())
SM100 = json.loads((configs.KERNELS_DIR / "sm100.json").read_text())
TENSOR_CORE = {"gemm": "bf16", "unit_gemm": "bf16", "attention_fwd": "", "attention_bwd_q": "", "attention_bwd_kv": ""}


def test_sm100_pins_every_kernel_sm90_pins_and_says_it_is_not_verified():
    from h3lab.triton import gemm_host

    assert SM100["verified"] is False and SM90["verified"] is True
    assert not configs.verified("sm100") and configs.verified("sm90")
    assert SM100["node_types"] == ["B200"] and configs.NODE_BY_CAPABILITY[(10, 0)] == "sm100"
    assert set(SM100["kernels"]) == set(SM90["kernels"])
    for kernel in ("gemm", "unit_gemm"):  # the keys each launcher accepts, every bucket, both dtypes
        for ieee in (False, True):
            for rows in (264, 4096):
                cfg = gemm_host.kernel_config(kernel, "sm100", ieee, rows=rows)
                assert cfg["BLOCK_K"] == gemm_host.kernel_config(kernel, "sm90", ieee, rows=rows)["BLOCK_K"]
    assert SM100["kernels"]["unit_gemm"]["IMPL"] == "triton"  # the Gluon kernel is written for wgmma (sm90)
    for name, entry in SM100["kernels"].items():  # one line each: the rule and the pinned choice
        assert "\n" not in entry["comment"] and len(entry["comment"]) <= 200, name


def test_every_pinned_sm100_kernel_compiles_for_sm100():
    """Every build the launchers can ask of sm100.json compiles for GPUTarget("cuda", 100, 32), fits
    the 227 KiB of shared memory a CTA may hold, and runs its products on sm100's tensor cores
    (tcgen05), not Hopper's (wgmma). A subprocess without TRITON_INTERPRET=1: interpreted kernels
    cannot be compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "h3lab.bench.compile_pinned", "--node", "sm100", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(b["kernel"], b["what"]) for b in built] == [(v.kernel, v.what) for v in compile_pinned.variants("sm100")]
    assert {b["kernel"] for b in built} == set(SM100["kernels"])
    for b in built:
        assert b["node"] == "sm100" and b["registers"] <= 255, b
        assert b["shared_bytes"] <= compile_pinned.SHARED_BYTES["sm100"], b
        assert b["wgmma"] == 0, b
        if b["kernel"] in TENSOR_CORE and b["what"].startswith(TENSOR_CORE[b["kernel"]]):
            assert b["tcgen05_mma"] > 0, b


def test_compile_pinned_refuses_a_node_without_a_target():
    with pytest.raises(ValueError, match=r"node 'sm80'; allowed: \['sm100', 'sm90'\]"):
        compile_pinned.compile_variant(compile_pinned.variants("sm100")[0], "sm80")


def test_a_backend_on_the_unverified_file_says_so(monkeypatch):
    """Every launch on sm100.json runs configurations no B200 has checked: the backend warns once, at
    construction, naming the file (kernels/README.md says what a B200 user gets)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the backend reads its own node's file; this names sm100 under the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as every interpreter test module sets it on a CPU
    from h3lab.triton.backend import TritonBackend

    with pytest.warns(UserWarning, match=r"kernels/sm100.json is not verified"):
        TritonBackend("cpu", node="sm100")
