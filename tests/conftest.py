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
