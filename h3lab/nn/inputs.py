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

Checked once. `ModelInputs` checks a request's values when it is made (each a host sync on a GPU).
The tensors `diffusers_kwargs` hands out are that request's own; a forward given exactly those
tensor objects, none written since (the same version counters: an in-place write to a view moves
its base's), reads the request as it is and checks only what the call adds (shapes, device, grad).
Any other tensors, or one written after the hand-out, make a new `ModelInputs` that checks them.

Dimension legend: S packed rows, Nv/Na/Nt video/audio/text rows, Cv/Ca/Ct their channels.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

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
    text rows keep their dtype (float32 or bfloat16). `ModelInputs` checks everything else, once: the
    tensors of a request as `diffusers_kwargs` handed them out are not checked again (module docstring).

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
    handed = _handed_out(kwargs, logical_keys)
    if handed is not None:
        # its values were checked when it was made (module docstring); what this call sets is valid by
        # construction: its own keys or the (0, j) ones (unique, >= 0), no conditioning rows (as below)
        keys = default_keys(handed.num_rows, device) if logical_keys is None else logical_keys
        return _unchecked(handed, logical_keys=keys, num_condition_video_rows=0, num_condition_audio_rows=0)
    S = kwargs["position_ids"].shape[0]
    return ModelInputs(
        video_rows=kwargs["hidden_states"][0].detach().to(torch.float32),
        audio_rows=kwargs["audio_hidden_states"][0].detach().to(torch.float32),
        text_rows=kwargs["encoder_hidden_states"][0].detach(),
        logical_keys=default_keys(S, device) if logical_keys is None else logical_keys,
        **{k: kwargs[k].detach() for k in LAYOUT_ARGS},
    )


def default_keys(rows: int, device: torch.device) -> Tensor:
    """[rows, 2] int64: row j of the packed sequence named (0, j), made on `device` (no host copy)."""
    return torch.stack(
        [torch.zeros(rows, dtype=torch.int64, device=device), torch.arange(rows, dtype=torch.int64, device=device)],
        dim=1,
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
    handed = _HandedOut(inputs, _versions(inputs))
    for name in ROW_STREAMS:
        _HANDED_OUT[out[name]] = handed
    return out | ({"logical_keys": inputs.logical_keys} if keys else {})


@dataclass(frozen=True, eq=False)
class _HandedOut:
    """A request `diffusers_kwargs` handed out, and its tensors' version counters at that moment."""

    inputs: ModelInputs
    versions: tuple[int, ...]


# each row-stream view `diffusers_kwargs` made -> its request (the entry goes with the view)
_HANDED_OUT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _versions(inputs: ModelInputs) -> tuple[int, ...]:
    return tuple(t._version for t in inputs.tensors().values())


def _handed_out(kwargs: dict[str, Tensor], logical_keys: Tensor | None) -> ModelInputs | None:
    """The request whose tensors `kwargs` (and `logical_keys`, unless None) are, as `diffusers_kwargs`
    handed them out and unwritten since, none requiring grad; None for any other tensors."""
    handed = _HANDED_OUT.get(kwargs["hidden_states"])
    if handed is None:
        return None
    inputs = handed.inputs
    if any(_HANDED_OUT.get(kwargs[n]) is not handed for n in ROW_STREAMS):
        return None
    if any(kwargs[k] is not getattr(inputs, k) for k in LAYOUT_ARGS):
        return None
    if logical_keys is not None and logical_keys is not inputs.logical_keys:
        return None
    if _versions(inputs) != handed.versions or any(t.requires_grad for t in inputs.tensors().values()):
        return None
    return inputs


def _unchecked(inputs: ModelInputs, **fields: object) -> ModelInputs:
    """`inputs` with `fields` replaced, without `ModelInputs`' checks (a copy field by field: its
    `__post_init__` does not run): only for values valid by construction, as the caller says."""
    out = copy.copy(inputs)
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out
