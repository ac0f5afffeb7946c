"""Canonical units of one block's weights: views, never copies, of the diffusers tensors.

Unit u (of 8): heads [u*H/8, (u+1)*H/8) of to_q/to_k/to_v (rows) and to_out.0 (input columns);
SwiGLU columns [u*F/8, (u+1)*F/8) of ff.net.0's hidden and gate halves (rows) and ff.net.2
(input columns); AdaLN output columns [u*18D/8, (u+1)*18D/8) of adaln_proj.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.config import NUM_UNITS, H3Config
from h3lab.weights import BlockWeights

UNIT_SHARDED = (
    "attn.to_q.weight",
    "attn.to_k.weight",
    "attn.to_v.weight",
    "attn.to_out.0.weight",
    "ff.net.0.proj.weight",
    "ff.net.2.weight",
    "adaln_proj.linear.weight",
    "adaln_proj.linear.bias",
)
REPLICATED = ("norm1.weight", "norm2.weight", "attn.norm_q.weight", "attn.norm_k.weight")


@dataclass(frozen=True, eq=False)
class UnitWeights:
    """The slices of a block that a rank holding `units` reads (all 8 in one process)."""

    config: H3Config
    units: range
    replicated: dict[str, Tensor]  # norm1, norm2, norm_q, norm_k: every rank reads all
    q: dict[int, Tensor]  # [A/8, D] per unit
    k: dict[int, Tensor]
    v: dict[int, Tensor]
    out: dict[int, Tensor]  # [D, A/8]
    hidden: dict[int, Tensor]  # [F/8, D]
    gate: dict[int, Tensor]
    down: dict[int, Tensor]  # [D, F/8]
    adaln_w: dict[int, Tensor]  # [18D/8, E]
    adaln_b: dict[int, Tensor]  # [18D/8]
    local: dict[str, Tensor]  # the same fields over all of `units` at once (contiguous ranges: views)


def unit_weights(weights: BlockWeights, units: range = range(NUM_UNITS)) -> UnitWeights:
    """Views of `weights` for the canonical units `units` (applied from outside; tensors untouched)."""
    if not units or units.start < 0 or units.stop > NUM_UNITS or units.step != 1:
        raise ValueError(f"units {units} must be a contiguous sub-range of range({NUM_UNITS})")
    c = weights.config
    A8, F8, G8 = c.inner_dim // NUM_UNITS, c.ffn_dim // NUM_UNITS, c.adaln_dim // NUM_UNITS
    w, F = weights, c.ffn_dim
    rows = lambda t, n, u, off=0: t[off + u * n : off + (u + 1) * n]  # noqa: E731
    cols = lambda t, n, u: t[:, u * n : (u + 1) * n]  # noqa: E731
    return UnitWeights(
        config=c,
        units=units,
        replicated={k: w[k] for k in REPLICATED},
        q={u: rows(w["attn.to_q.weight"], A8, u) for u in units},
        k={u: rows(w["attn.to_k.weight"], A8, u) for u in units},
        v={u: rows(w["attn.to_v.weight"], A8, u) for u in units},
        out={u: cols(w["attn.to_out.0.weight"], A8, u) for u in units},
        hidden={u: rows(w["ff.net.0.proj.weight"], F8, u) for u in units},
        gate={u: rows(w["ff.net.0.proj.weight"], F8, u, F) for u in units},
        down={u: cols(w["ff.net.2.weight"], F8, u) for u in units},
        adaln_w={u: rows(w["adaln_proj.linear.weight"], G8, u) for u in units},
        adaln_b={u: rows(w["adaln_proj.linear.bias"], G8, u) for u in units},
        local={
            "q": w["attn.to_q.weight"][units.start * A8 : units.stop * A8],
            "k": w["attn.to_k.weight"][units.start * A8 : units.stop * A8],
            "v": w["attn.to_v.weight"][units.start * A8 : units.stop * A8],
            "out": w["attn.to_out.0.weight"][:, units.start * A8 : units.stop * A8],
            "hidden": w["ff.net.0.proj.weight"][units.start * F8 : units.stop * F8],
            "gate": w["ff.net.0.proj.weight"][F + units.start * F8 : F + units.stop * F8],
            "down": w["ff.net.2.weight"][:, units.start * F8 : units.stop * F8],
            "adaln_w": w["adaln_proj.linear.weight"][units.start * G8 : units.stop * G8],
            "adaln_b": w["adaln_proj.linear.bias"][units.start * G8 : units.stop * G8],
        },
    )


def join(pieces: list[Tensor], dim: int) -> Tensor:
    """torch.cat(pieces, dim), but a view when the pieces already lie end to end in one tensor.

    block_step hands out each weight gradient as per-unit views of one GEMM output; copying them
    back together cost 1.2 ms per real-size block (H200) and a second copy of every weight
    gradient (1.3 GB at real size).
    """
    first = pieces[0]
    step = first.stride(dim) * first.element_size()
    offset = first.data_ptr()
    adjacent = True
    for p in pieces:
        same_layout = p.dtype == first.dtype and p.stride() == first.stride() and p.device == first.device
        other_dims = p.shape[:dim] + p.shape[dim + 1 :] == first.shape[:dim] + first.shape[dim + 1 :]
        same_storage = p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same_layout and other_dims and same_storage and p.data_ptr() == offset):
            adjacent = False
            break
        offset += p.shape[dim] * step
    if not adjacent:
        return torch.cat(pieces, dim=dim)
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    return first.as_strided(shape, first.stride(), first.storage_offset())


def assemble_unit_grads(grads: dict[str, dict[int, Tensor]], units: range) -> dict[str, Tensor]:
    """Per-unit weight gradients -> diffusers-shaped tensors covering `units` (the full tensor for all 8).

    ff.net.0.proj.weight stacks the hidden rows of `units`, then their gate rows.
    """
    cat0 = lambda name: join([grads[name][u] for u in units], dim=0)  # noqa: E731
    return {
        "attn.to_q.weight": cat0("attn.to_q.weight"),
        "attn.to_k.weight": cat0("attn.to_k.weight"),
        "attn.to_v.weight": cat0("attn.to_v.weight"),
        "attn.to_out.0.weight": join([grads["attn.to_out.0.weight"][u] for u in units], dim=1),
        "ff.net.0.proj.weight": join([cat0("ff.hidden"), cat0("ff.gate")], dim=0),
        "ff.net.2.weight": join([grads["ff.net.2.weight"][u] for u in units], dim=1),
        "adaln_proj.linear.weight": cat0("adaln_proj.linear.weight"),
        "adaln_proj.linear.bias": cat0("adaln_proj.linear.bias"),
    }


# block_step's per-unit gradient names -> the UnitWeights field holding the same slice
UNIT_GRAD_FIELDS = {
    "attn.to_q.weight": "q",
    "attn.to_k.weight": "k",
    "attn.to_v.weight": "v",
    "attn.to_out.0.weight": "out",
    "ff.hidden": "hidden",
    "ff.gate": "gate",
    "ff.net.2.weight": "down",
    "adaln_proj.linear.weight": "adaln_w",
    "adaln_proj.linear.bias": "adaln_b",
}


def unit_slice(full: UnitWeights, grad_name: str, unit: int) -> Tensor:
    """The slice of a full per-parameter tensor set (e.g. canonical dW as UnitWeights) for one unit."""
    return getattr(full, UNIT_GRAD_FIELDS[grad_name])[unit]
