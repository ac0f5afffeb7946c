"""Shared fixtures: the tiny configuration, its synthetic weights and packed batches."""

from __future__ import annotations

import pytest
import torch

from h3lab import H3Config, packed_batch, synthetic_block
from h3lab.metrics import bit_pattern


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
