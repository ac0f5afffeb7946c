"""h3lab.emulate.wgmma gives h3lab.emulate.mma's bits: every recipe of the MMA probe, every model
variant the probe tested, every accumulator mode, batched and ragged; both its paths run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from h3lab.bench import mma_cases
from h3lab.bench.probe_rng import Stream
from h3lab.emulate import mma, wgmma
from tests.conftest import assert_bitwise

VARIANTS = {
    "sm90": mma.SM90,
    "overflow_inf": dataclasses.replace(mma.SM90, overflow="inf"),
    "zero_positive": dataclasses.replace(mma.SM90, zero_sign="positive"),
    "flush_output": dataclasses.replace(mma.SM90, subnormal_output="flush"),
    "flush_inputs": dataclasses.replace(mma.SM90, subnormal_inputs="flush"),
    "extra_bits_1": dataclasses.replace(mma.SM90, extra_bits=1),
}


@pytest.mark.parametrize("recipe", sorted(mma_cases.RECIPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_recipe_variant_and_accumulator_gives_the_models_bits(recipe, dtype):
    a, b, c = mma_cases.RECIPES[recipe](Stream(77 + len(recipe)), 2, 8, 24, 64, dtype)
    for name, model in VARIANTS.items():
        for acc in (None, torch.zeros_like(c), c):
            want = mma.dot(a, b, acc, model=model, block_k=32)
            assert_bitwise(wgmma.dot(a, b, acc, model=model, block_k=32), want, f"{recipe} {name}")


def test_batched_ragged_and_chained_dots_give_the_models_bits():
    s = Stream(5)
    a = mma_cases.values(s, (3, 5, 40), -6, 6, torch.bfloat16)  # K = 40: a ragged last chunk
    b = mma_cases.values(s, (40, 7), -6, 6, torch.bfloat16)  # broadcast over the batch
    c = mma_cases.values(s, (3, 5, 7), -2, 8, torch.float32)
    assert_bitwise(wgmma.dot(a, b, c, block_k=64), mma.dot(a, b, c, block_k=64))
    pieces = [(a, b), (a[..., :16], b[:16])]
    assert_bitwise(wgmma.chain_dot(pieces, c, block_k=32), mma.chain_dot(pieces, c, block_k=32))


def test_the_fast_path_runs_where_it_holds_and_the_exact_path_elsewhere(monkeypatch):
    taken = []
    fast = wgmma._fast_step
    monkeypatch.setattr(wgmma, "_fast_step", lambda *args: taken.append(r := fast(*args)) or r)
    s = Stream(9)
    a = mma_cases.values(s, (16, 32), -4, 4, torch.bfloat16)
    b = mma_cases.values(s, (32, 16), -4, 4, torch.bfloat16)
    wgmma.dot(a, b, torch.zeros(16, 16))
    assert taken and all(r is not None for r in taken)  # ordinary values: FP32 products throughout
    taken.clear()
    wgmma.dot(a * 2.0**-70, b * 2.0**-70, None)  # products near 2^-140: below FP32's normal range
    assert taken and all(r is None for r in taken)


def test_a_dot_with_an_infinity_is_the_models():
    a = torch.tensor([[1.0, float("inf")] + [0.0] * 14], dtype=torch.bfloat16)
    b = torch.tensor([[2.0], [-3.0]] + [[1.0]] * 14, dtype=torch.bfloat16)
    assert_bitwise(wgmma.dot(a, b), mma.dot(a, b))
    assert float(wgmma.dot(a, b)) == float("-inf")
