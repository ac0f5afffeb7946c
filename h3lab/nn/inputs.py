"""diffusers' forward arguments as h3lab's `ModelInputs`, and back.

`MiniMaxH3Transformer3DModel.forward` (0.42.1) takes one packed request with a batch axis that only
replicates it: [B, Nv, Cv] video rows, [B, Na, Ca] audio rows, [B, Nt, Ct] text rows, and the
layout tensors of one packed sequence (timestep, timestep_indices, token_tags, position_ids, the
three index tensors). A parallelized model (h3lab.nn.apply) runs B = 1; the rows keep their
order and their places, whatever they are.

Rows have names (`logical_keys`, h3lab's contract rule 3): every reduction over rows takes them in
key order. diffusers has no such argument; by default row j of the packed sequence is (0, j), so the
bits follow the packing the caller chose. `logical_keys=` ([S, 2] int64, unique, first key >= 0) names
the rows instead, so a request packed in another order gives, row for row, the same bytes.

Dimension legend: S packed rows, Nv/Na/Nt video/audio/text rows, Cv/Ca/Ct their channels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.model.inputs import ModelInputs

ROW_STREAMS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")  # [B, rows, channels] each
LAYOUT_ARGS = (
    "timestep",
    "timestep_indices",
    "token_tags",
    "position_ids",
    "video_indices",
    "audio_indices",
    "text_indices",
)


def model_inputs_of(kwargs: dict[str, Tensor], device: torch.device, logical_keys: Tensor | None) -> ModelInputs:
    """The request of diffusers' forward arguments `kwargs` (ROW_STREAMS and LAYOUT_ARGS), on `device`.

    Video and audio rows are cast to float32 (as diffusers casts them to its float32 projections);
    text rows keep their dtype (float32 or bfloat16). `ModelInputs` checks everything else.

    Raises:
        ValueError: a batch axis other than 1, a tensor on another device than the model's, an input
            that requires grad where grad is enabled (h3lab computes the parameters' gradients only),
            or anything `ModelInputs` refuses.
    """
    for name in ROW_STREAMS:
        t = kwargs[name]
        if t.ndim != 3 or t.shape[0] != 1:
            raise ValueError(f"{name}: shape {list(t.shape)}; allowed: [1, rows, channels] (a batch of one request)")
    for name, t in [*kwargs.items(), ("logical_keys", logical_keys)]:
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} on {t.device}; allowed: {device} (the model's device)")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad; allowed: inputs without gradients (h3lab computes the parameters' gradients)"
            )
    S = kwargs["position_ids"].shape[0]
    if logical_keys is None:
        logical_keys = torch.stack([torch.zeros(S, dtype=torch.int64), torch.arange(S)], dim=1).to(device)
    return ModelInputs(
        video_rows=kwargs["hidden_states"][0].detach().to(torch.float32),
        audio_rows=kwargs["audio_hidden_states"][0].detach().to(torch.float32),
        text_rows=kwargs["encoder_hidden_states"][0].detach(),
        logical_keys=logical_keys,
        **{k: kwargs[k].detach() for k in LAYOUT_ARGS},
    )


def diffusers_kwargs(inputs: ModelInputs, *, keys: bool = False) -> dict[str, Tensor]:
    """`inputs` as the keyword arguments of diffusers' forward (batch axis 1); `keys=True` adds
    `logical_keys`, which a parallelized model reads and diffusers' own model refuses."""
    out = {
        "hidden_states": inputs.video_rows[None],
        "audio_hidden_states": inputs.audio_rows[None],
        "encoder_hidden_states": inputs.text_rows[None],
    }
    out |= {k: getattr(inputs, k) for k in LAYOUT_ARGS}
    return out | ({"logical_keys": inputs.logical_keys} if keys else {})
