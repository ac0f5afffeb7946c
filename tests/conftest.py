"""Shared fixtures and helpers: the tiny configuration, its synthetic weights and packed batches; the
Triton interpreter's tl.dot as an FP32 chain of our own (chain_dot); the processes a launch left
behind (leftovers)."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

# Without CUDA the kernel tests run under the Triton interpreter. It must be chosen before anything
# imports triton.language (diffusers and torch can, through a test module collected first): a
# kernel interpreted after that calls the compiled library's jit functions (tl.zeros) and fails.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from h3lab import H3Config, packed_batch, synthetic_block
from h3lab.metrics import bit_pattern


def gpu_kernels(test_file: str):
    """The decorator of a kernel test file's GPU tests: compiled kernels on a CUDA device, skipped
    without one and under the Triton interpreter (whose bf16 is wrong), saying how to run them."""
    from h3lab.triton.configs import interpreting

    command = f"pytest -m gpu tests/{Path(test_file).name}"

    def gpu(fn):
        fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)
        fn = pytest.mark.skipif(interpreting(), reason=f"TRITON_INTERPRET=1 in this process; run: {command}")(fn)
        return pytest.mark.gpu(fn)

    return gpu


@pytest.fixture(scope="session")
def tiny() -> H3Config:
    return H3Config.tiny()


@pytest.fixture(scope="session")
def tiny_weights(tiny):
    return synthetic_block(tiny, 0, seed=11)


@pytest.fixture(scope="session")
def tiny_batch(tiny):
    return packed_batch(tiny, 264, seed=12)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Byte equality: same dtype, same shape, same bit patterns (so -0 != +0, NaN payloads count)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bit_pattern(a), bit_pattern(b)), f"{what}: bits differ"


def leftovers(token: str) -> list[int]:
    """Processes of the launch tagged `token` still alive (other test sessions' launches carry other
    tokens)."""
    from h3lab.launch.launcher import processes_with_token

    return [p.pid for p in processes_with_token(token)]


def sigint_at_default() -> None:
    """`preexec_fn` of a command a test sends Ctrl-C (SIGINT): SIGINT at its default there, whatever this
    process inherited. A shell's background job (`pytest &`, nohup) ignores SIGINT, an ignored signal
    stays ignored across exec, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def random_diffusers_model(config: H3Config, seed: int):
    """diffusers' MiniMaxH3Transformer3DModel with its constructor's init (nn.Linear: U(+-1/sqrt(fan_in))),
    seeded; RMSNorm weights (init ones) 1 + 0.1 N(0, 1); the real checkpoint's mixed precision, which
    load_block checks. diffusers is imported here so that tests without the parity extra never need it."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from h3lab.config import param_dtype

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = MiniMaxH3Transformer3DModel(**config.to_dict())
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.weight.data = 1.0 + 0.1 * torch.randn_like(module.weight)
    for name, p in model.named_parameters():
        p.data = p.data.to(param_dtype(name))
    return model


def chain_dot_f32(a_MK: np.ndarray, b_KN: np.ndarray, acc_MN: np.ndarray) -> np.ndarray:
    """acc + a @ b as one FP32 chain per element, k ascending, continued from acc.

    out[m, n] = ((acc[m, n] + a[m, 0] b[0, n]) + a[m, 1] b[1, n]) + ..., each product and each add a
    numpy float32 elementwise op: IEEE, rounded to nearest, no FMA, no BLAS. An element's bits are a
    function of its acc, its row of a and its column of b alone: not of M, N, the element's place in
    the tile or the CPU. The chain starts from acc (the GPU's IEEE tl.dot is an FMA chain from the
    accumulator too), so a kernel's loop acc = dot(a_chunk, b_chunk, acc) is one chain over all of
    K whatever BLOCK_K is, and an FP32 GEMM equals h3lab.ops.chain.chain_mm bit for bit. Leading
    batch dims (3-D tl.dot) broadcast.
    """
    out = acc_MN.astype(np.float32, copy=True)
    prod = np.empty_like(out)
    a_KM = np.ascontiguousarray(np.swapaxes(a_MK, -1, -2))
    for k in range(a_MK.shape[-1]):
        np.multiply(a_KM[..., k, :, None], b_KN[..., k, None, :], out=prod)
        np.add(out, prod, out=out)
    return out


@pytest.fixture
def chain_dot(monkeypatch):
    """The Triton interpreter's tl.dot as chain_dot_f32, for the test, then the interpreter's own again.

    The interpreter computes tl.dot with np.matmul, i.e. the host's BLAS. Its kernel is picked per
    CPU and sums k in an order that depends on the product's shape (a row alone or inside a tile:
    other bits under every OpenBLAS core type tried) and, with OpenBLAS' Haswell and Zen kernels,
    on the row's place in a product of one shape. Kernel-logic tests need an order of our own.
    bf16 and fp16 operands widen to FP32 exactly first (the interpreter stores bf16 as its uint16
    bits, which np.matmul would multiply as integers); their products are exact in FP32.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    def widened(x) -> np.ndarray:
        ty = x.get_element_ty()
        if ty == tl.bfloat16:
            return (x.data.astype(np.uint32) << 16).view(np.float32)
        if ty in (tl.float16, tl.float32):
            return x.data.astype(np.float32, copy=False)
        raise NotImplementedError(f"chain_dot: operand dtype {ty}; allowed: fp32, bf16, fp16")

    def create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc):
        if d.get_element_ty() != tl.float32:
            raise NotImplementedError(f"chain_dot: accumulator dtype {d.get_element_ty()}; allowed: fp32")
        return interpreter.TensorHandle(chain_dot_f32(widened(a), widened(b), d.data), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


# diffusers parity: a small config and one with odd widths (16 heads of 24, text 40, 5 audio channels)
MODEL_CONFIGS = {
    "tiny": H3Config.tiny().replace(num_layers=2),
    "h16x24": H3Config.tiny().replace(
        num_layers=3,
        num_attention_heads=16,
        attention_head_dim=24,
        hidden_size=64,
        ffn_dim=128,
        text_dim=40,
        in_channels=6,
        audio_in_channels=5,
        freq_dim=16,
        time_embed_hidden_dim=80,
        time_embed_dim=48,
        rope_freq_dim=3,
        rope_theta=500.0,
        norm_eps=1e-6,
        qk_norm_eps=1e-4,
        final_norm_eps=1e-6,
    ),
}


def model_in_dtype(model, dtype: torch.dtype):
    """A copy with every parameter and float buffer in `dtype` (quietly: `.to()` warns about fp32 modules)."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)
    return model


# h3lab.bench.host_syncs' site of ModelInputs' checks that read a value back (finiteness, partition,
# timestep range, row ints, keys): a fresh check of a request reads them together (h3lab.checks)
REQUEST_CHECKS = frozenset({"h3lab/model/inputs.py:__post_init__"})


# the CLI: a run's arguments, and the one line a bad value must give
RUN = ["run", "--layout", "tp2", "--synthetic", "tiny", "--rows", "8"]


def one_line_error(capsys, argv: list[str], *expected: str, rc: int = 2) -> str:
    """`h3lab ARGV` exits `rc` with one line on stderr, no traceback, holding every `expected` text."""
    from h3lab.cli import main

    assert main(argv) == rc
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err
