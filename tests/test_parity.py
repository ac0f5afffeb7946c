"""The canonical block against diffusers 0.42.1: float32 parity through a diffusers checkpoint, and bf16 accuracy.

(a) A random `MiniMaxH3Transformer3DModel`, saved by diffusers' own `save_pretrained` (sharded),
loaded through `h3lab.load_block`: canonical_block in float32 against autograd through diffusers'
block in float32, fed from the model's in-memory parameters (so the h3lab loader is on one side
only). Metric: max_rel = max|ours - diffusers| / max|diffusers| per tensor. We use it, not
relative L2, because a localized bug (one row in the wrong order, one unit's columns, one head)
shows in it at full size, while L2 over N elements dilutes it by up to sqrt(N). Measured over the
6 cases below: out <= 1.2e-7, dx <= 1.4e-7, dtemb <= 1.0e-6, worst dW 1.3e-6 (tiny, attn.norm_k):
both sides are float32 (unit roundoff 6e-8) in different operation orders. Tolerances are the
issue's: 1e-5 for out (~80x headroom), 1e-4 for dx, dtemb and every dW (~75x headroom; backward
chains are longer); one bf16 rounding anywhere (unit roundoff 2e-3) or a wrong formula misses them
by orders of magnitude.

(b) bfloat16, both against the FP64 oracle, per tensor: relative L2 (the accuracy of the tensor as
a whole; max_rel compares one extreme element per side and its ratio scatters 0.36..1.53 over the
same runs), as a root mean square over 2 seeds (weights seed s, batch seed 100 + s, 264 rows). One
seed alone is too noisy to order two errors that differ by ~15%: over 3 configs x 6 seeds (270
tensor comparisons) single-seed ratios ours/diffusers span 0.48..1.19 and 6 exceed 1, all dW
(h16x24 s5 to_v 1.02; h8x16 s1 norm_q 1.05, s2 norm_k 1.07, s5 to_v 1.19, to_out 1.09, norm2
1.08). Over seeds 0 and 1 the ratio is, min..max over the 15 tensors: tiny 0.67..0.87, h16x24
0.67..0.88, h8x16 0.68..0.88 (6 seeds: 0.74..0.84, 0.65..0.85, 0.72..0.87), so the test keeps
>10% headroom for the shifts another CPU's bf16 kernels bring to diffusers' side. Absolute figures,
out (tiny, seed 0): canonical 5.1e-3, diffusers 5.8e-3 (bf16 unit roundoff 2e-3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h3lab.batch import packed_batch
from h3lab.block import canonical_block
from h3lab.config import H3Config
from h3lab.io.checkpoint import load_block
from h3lab.metrics import bitwise_equal, error_stats
from h3lab.reference.oracle import oracle_block
from h3lab.reference.parity import diffusers_block
from h3lab.weights import BlockWeights, synthetic_block
from tests.conftest import random_diffusers_model

INDEX = "diffusion_pytorch_model.safetensors.index.json"
# (config, packed rows, padding rows); heads x head_dim differ, attention width != hidden, partial RoPE
CONFIGS = {
    "tiny": (H3Config.tiny().replace(num_layers=2), 264, 0),
    "h16x24": (
        H3Config.tiny().replace(
            num_layers=2,
            num_attention_heads=16,
            attention_head_dim=24,
            hidden_size=64,
            ffn_dim=128,
            time_embed_dim=48,
            rope_freq_dim=3,
            rope_theta=500.0,
            norm_eps=1e-6,
            qk_norm_eps=1e-4,
        ),
        150,
        3,
    ),
    "h8x16": (
        H3Config.tiny().replace(
            num_layers=2, num_attention_heads=8, attention_head_dim=16, hidden_size=48, ffn_dim=64, rope_freq_dim=2
        ),
        97,
        5,
    ),
}
OUT_RTOL = 1e-5
GRAD_RTOL = 1e-4
BF16_SEEDS = (0, 1)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_matches_diffusers_through_save_pretrained(tmp_path: Path, name: str, seed: int) -> None:
    config, rows, padding = CONFIGS[name]
    model = random_diffusers_model(config, seed)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path, max_shard_size=total // 4)  # at least 4 shards
    assert len(json.loads((tmp_path / INDEX).read_text())["weight_map"]) == len(list(model.parameters()))
    assert len(list(tmp_path.glob("*.safetensors"))) >= 4

    index = seed  # both blocks of the two-block model
    ours_w = load_block(tmp_path, index, dtype=torch.float32)
    theirs = dict(model.transformer_blocks[index].named_parameters())
    assert all(torch.equal(ours_w[k], theirs[k].float()) for k in ours_w)  # bf16 -> fp32 is exact
    ref_w = BlockWeights(config, {k: p.detach() for k, p in theirs.items()}, source=f"diffusers#block{index}")

    batch = packed_batch(config, rows, seed=1000 + seed, padding=padding, dtype=torch.float32)
    ours = canonical_block(ours_w, batch).tensors()
    ref = diffusers_block(ref_w, batch, dtype=torch.float32).tensors()
    assert ours.keys() == ref.keys()
    errors = {}
    for k, t in ours.items():
        assert t.dtype == ref[k].dtype == torch.float32, k
        errors[k] = error_stats(t, ref[k].double())["max_rel"]
        assert errors[k] <= (OUT_RTOL if k == "out" else GRAD_RTOL), f"{name} seed {seed} {k}: {errors[k]:.3g}"
    if padding:  # padding rows are +0 bytes on both sides (diffusers_block drops them, canonical_block zeroes them)
        for k in ("out", "dx"):
            for t in (ours[k], ref[k]):
                assert bitwise_equal(t[~batch.active], torch.zeros_like(t[~batch.active])), k


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_error_is_no_worse_than_diffusers_bf16(name: str) -> None:
    config = CONFIGS[name][0]
    mean_sq: dict[str, list[float]] = {}  # tensor -> [ours, diffusers]: relative L2 squared, summed over seeds
    for seed in BF16_SEEDS:
        weights = synthetic_block(config, 0, seed=seed)
        batch = packed_batch(config, 264, seed=100 + seed)
        fp64 = oracle_block(weights, batch).tensors()
        ours = canonical_block(weights, batch).tensors()
        theirs = diffusers_block(weights, batch, dtype=torch.bfloat16).tensors()
        for k, ref in fp64.items():
            assert ours[k].dtype == theirs[k].dtype, k  # bf16, and float32 for dtemb on both sides
            acc = mean_sq.setdefault(k, [0.0, 0.0])
            for i, t in enumerate((ours, theirs)):
                acc[i] += error_stats(t[k], ref)["rel_l2"] ** 2
    ratios = {k: (ours_sq / theirs_sq) ** 0.5 for k, (ours_sq, theirs_sq) in mean_sq.items()}
    assert len(ratios) == 15
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= 1.0, f"{name}: {worst} error {ratios[worst]:.2f}x diffusers' bf16 error"
