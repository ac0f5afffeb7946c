"""h3lab.reference.oracle against diffusers' MiniMaxH3TransformerBlock (both float64), and its padding semantics.

Tolerances. Oracle vs diffusers: both run in float64 (unit roundoff 1.1e-16) but in different
operation orders (SDPA scales q and k separately, different GEMM blockings, fused norms), so they
differ by a few hundred roundoffs at most; 1e-10 relative leaves ~10^4 of headroom over what we see
(~2e-15) yet fails by ~10^3 if either side rounded anything to float32 (6e-8) or got a formula
wrong. Padded vs unpadded oracle: the same code on a different row count changes only GEMM and
reduction orders, so 1e-12 is tighter still.
"""

import dataclasses

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed, MiniMaxH3TransformerBlock

from h3lab.batch import PackedBatch, packed_batch
from h3lab.block.result import BlockResult
from h3lab.config import H3Config, block_param_shapes
from h3lab.metrics import bitwise_equal, error_stats
from h3lab.reference.oracle import oracle_block, rope_cos_sin
from h3lab.weights import BlockWeights, synthetic_block

# tiny, and a second shape with 16 x 24 heads (A=384 != D=64), 18 of 24 channels rotated, and eps /
# theta values that differ from each other so a swapped constant shows up
CONFIGS = {
    "tiny": H3Config.tiny(),
    "h16x24": H3Config.tiny().replace(
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
}
DIFFUSERS_RTOL = 1e-10
PADDING_RTOL = 1e-12


def _diffusers_block(weights: BlockWeights, batch: PackedBatch) -> BlockResult:
    """diffusers' block in float64 on one sequence [1, S, D], with the oracle's float64 cos/sin."""
    c = weights.config
    block = MiniMaxH3TransformerBlock(
        c.hidden_size,
        c.num_attention_heads,
        c.attention_head_dim,
        c.ffn_dim,
        c.time_embed_dim,
        c.norm_eps,
        c.qk_norm_eps,
    )
    block.load_state_dict({k: v.double() for k, v in weights.items()})
    block.double()
    x_1SD = batch.hidden_states.double()[None].requires_grad_()
    temb_TE = batch.temb.double().requires_grad_()
    # diffusers' rotary module computes in float32; feed both sides the same float64 cos/sin
    # (test_rope_matches_diffusers checks the formula separately)
    out_1SD = block(x_1SD, temb_TE, batch.adaln_indices, rope_cos_sin(batch.position_ids, c))
    out_1SD.backward(batch.grad_out.double()[None])
    dw = {k: p.grad for k, p in block.named_parameters()}
    return BlockResult(out=out_1SD[0].detach(), dx=x_1SD.grad[0], dw=dw, dtemb=temb_TE.grad)


def _assert_close(got: BlockResult, want: BlockResult, rtol: float) -> dict[str, float]:
    """max_rel of every tensor of `got` against `want`; all must be within `rtol`."""
    assert set(got.dw) == set(want.dw) == set(block_param_shapes(CONFIGS["tiny"]))
    errors = {}
    for name, tensor in got.tensors().items():
        assert tensor.dtype == torch.float64, name
        errors[name] = error_stats(tensor, want.tensors()[name])["max_rel"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, f"{worst}: max_rel {errors[worst]:.3g} > {rtol:g}"
    return errors


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_oracle_matches_diffusers(config_name: str, seed: int) -> None:
    config = CONFIGS[config_name]
    weights = synthetic_block(config, 0, seed=seed)
    batch = packed_batch(config, 60 + 40 * seed, seed=100 + seed, num_timesteps=2 + seed % 2)
    _assert_close(oracle_block(weights, batch), _diffusers_block(weights, batch), DIFFUSERS_RTOL)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_rope_matches_diffusers(config_name: str) -> None:
    config = CONFIGS[config_name]
    position_ids = torch.randint(0, 64, (300, 3), generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(position_ids, config)
    cos32, sin32 = MiniMaxH3RotaryPosEmbed(config.rope_freq_dim, config.rope_theta)(position_ids)
    assert cos.shape == (300, config.rotary_dim)
    # diffusers rounds angles up to 64 rad to float32 (half-ulp 3.8e-6) and inv_freq to float32
    assert (cos32.double() - cos).abs().max() < 1e-5
    assert (sin32.double() - sin).abs().max() < 1e-5


@pytest.mark.parametrize(("seed", "padding"), [(0, 1), (1, 7), (2, 40)])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_padding_rows_change_nothing(config_name: str, seed: int, padding: int) -> None:
    config = CONFIGS[config_name]
    weights = synthetic_block(config, 0, seed=10 + seed)
    padded = packed_batch(config, 50 + 30 * seed, seed=200 + seed, padding=padding)
    active = padded.active
    got, want = oracle_block(weights, padded), oracle_block(weights, padded.rows(active))

    for name in ("out", "dx"):
        padded_rows = getattr(got, name)[~active]
        assert padded_rows.shape[0] == padding
        assert bitwise_equal(padded_rows, torch.zeros_like(padded_rows)), f"{name}: padding rows not +0"
    active_rows = BlockResult(out=got.out[active], dx=got.dx[active], dw=got.dw, dtemb=got.dtemb)
    _assert_close(active_rows, want, PADDING_RTOL)


def test_padding_contents_never_reach_active_rows() -> None:
    config = CONFIGS["tiny"]
    weights = synthetic_block(config, 0, seed=20)
    batch = packed_batch(config, 70, seed=21, padding=6)
    pad = ~batch.active
    poison = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, float("nan")])
    hidden, grad = batch.hidden_states.clone(), batch.grad_out.clone()
    hidden[pad] = poison[:, None].to(hidden.dtype)
    grad[pad] = float("nan")
    poisoned = dataclasses.replace(batch, hidden_states=hidden, grad_out=grad)

    clean, dirty = oracle_block(weights, batch).tensors(), oracle_block(weights, poisoned).tensors()
    for name, tensor in clean.items():
        assert bitwise_equal(tensor, dirty[name]), name


def test_oracle_rejects_a_batch_of_another_config() -> None:
    weights = synthetic_block(CONFIGS["tiny"], 0, seed=0)
    batch = packed_batch(CONFIGS["h16x24"], 20, seed=0)
    with pytest.raises(ValueError, match="hidden_size=192"):
        oracle_block(weights, batch)
