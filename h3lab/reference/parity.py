"""diffusers' `MiniMaxH3TransformerBlock` as a reference: forward, then backward through autograd.

The block runs exactly as `MiniMaxH3Transformer3DModel` (0.42.1) runs it: hidden states [1, S, D]
and parameters in `dtype`, `temb` in float32 (the time embedder is a float32 module; in float64
too when `dtype` is float64), cos/sin from diffusers' own `MiniMaxH3RotaryPosEmbed` in float32
(the model keeps `rope` in float32 and `_apply_rotary_emb` casts to the hidden dtype), attention
through diffusers' dispatch (torch SDPA). So `dtype=torch.bfloat16` measures diffusers' own bf16
error, `torch.float64` gives a reference free of bf16/fp32 activation rounding.

Padding: diffusers has none (one packed request, every row a key). Rows whose first logical key is
negative are dropped before the block runs and come back as zero rows of `out` and `dx`, which is
h3lab's padding contract, so results line up row for row with `canonical_block`'s.

diffusers is an optional dependency: `pip install -e ".[parity]"`.
"""

from __future__ import annotations

import torch

from h3lab.batch import PackedBatch
from h3lab.block.result import BlockResult
from h3lab.model.inputs import ModelInputs
from h3lab.weights import BlockWeights

DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def diffusers_available() -> bool:
    """True when diffusers (the `parity` extra) can be imported."""
    try:
        diffusers_module()
    except ImportError:
        return False
    return True


def diffusers_module():
    try:
        from diffusers.models.transformers import transformer_minimax_h3
    except ImportError as err:
        raise ImportError(
            f"h3lab.reference.parity needs diffusers==0.42.1 ({err}); "
            "install the parity extra: pip install -e '.[parity]'"
        ) from err
    return transformer_minimax_h3


def model_velocity(model: torch.nn.Module, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' `MiniMaxH3Transformer3DModel` on one packed request: (video [Nv, Cv], audio [Na, Ca]),
    in the order of `inputs.video_indices` / `audio_indices`; autograd records it where grad is enabled."""
    video, audio = model(
        hidden_states=inputs.video_rows[None],
        audio_hidden_states=inputs.audio_rows[None],
        encoder_hidden_states=inputs.text_rows[None],
        timestep=inputs.timestep,
        timestep_indices=inputs.timestep_indices,
        token_tags=inputs.token_tags,
        position_ids=inputs.position_ids,
        video_indices=inputs.video_indices,
        audio_indices=inputs.audio_indices,
        text_indices=inputs.text_indices,
        return_dict=False,
    )
    return video[0], audio[0]


def diffusers_block(weights: BlockWeights, batch: PackedBatch, *, dtype: torch.dtype) -> BlockResult:
    """diffusers' block on `batch`: out, dx and every dW in `dtype`; dtemb in temb's dtype.

    Args:
        weights: one block's tensors (any dtype; cast to `dtype`).
        batch: one packed request; padding rows are dropped (see the module docstring).
        dtype: bfloat16, float32 or float64. temb stays float32 for bf16 and fp32, as in the model,
            so `dtemb` is float32 there and float64 for a float64 run.

    Returns:
        `BlockResult` with `dw` keyed by diffusers names in `weights`' order.

    Raises:
        ValueError: `dtype` not allowed, or the batch does not fit the weights' config.
        ImportError: diffusers is not installed (the `parity` extra).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} not allowed; allowed: {list(DTYPES)}")
    c = weights.config
    if batch.hidden_states.shape[1] != c.hidden_size or batch.temb.shape[1] != c.time_embed_dim:
        raise ValueError(
            f"batch has hidden {batch.hidden_states.shape[1]}, time_embed_dim {batch.temb.shape[1]}; the "
            f"weights' config expects hidden_size={c.hidden_size}, time_embed_dim={c.time_embed_dim}"
        )
    m = diffusers_module()
    block = m.MiniMaxH3TransformerBlock(
        c.hidden_size,
        c.num_attention_heads,
        c.attention_head_dim,
        c.ffn_dim,
        c.time_embed_dim,
        c.norm_eps,
        c.qk_norm_eps,
    )
    block.load_state_dict(dict(weights.items()))  # copies into the fresh parameters, cast to their dtype
    block.to(device=batch.device, dtype=dtype)
    active = batch.active
    b = batch.rows(active)
    rope = m.MiniMaxH3RotaryPosEmbed(c.rope_freq_dim, c.rope_theta).to(batch.device)
    temb_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = b.hidden_states.detach().to(dtype)[None].requires_grad_()  # detach: never mark the caller's tensors
    temb = b.temb.detach().to(temb_dtype).requires_grad_()
    with torch.enable_grad():
        out = block(x, temb, b.adaln_indices, rope(b.position_ids))
        out.backward(b.grad_out.to(dtype)[None])
    params = dict(block.named_parameters())

    def scatter(rows):  # active rows back to their places; padding rows +0
        full = rows.new_zeros((batch.num_rows, rows.shape[1]))
        full[active] = rows
        return full

    return BlockResult(
        out=scatter(out.detach()[0]),
        dx=scatter(x.grad[0]),
        dw={k: params[k].grad for k in weights},
        dtemb=temb.grad,
    )
