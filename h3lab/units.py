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


# ---- a rank's shards: the slices of the unit-sharded parameters it keeps, and the full tensor again ------
# A rank holding units [a, b) keeps one tensor per unit-sharded parameter (`unit_shards`): the rows (or
# the input columns, SHARD_DIM 1) of those units, in unit order; ff.net.0.proj.weight keeps its units'
# hidden rows, then their gate rows. The replicated tensors it keeps whole.
SHARD_DIM = {p: 1 if p in ("attn.to_out.0.weight", "ff.net.2.weight") else 0 for p in UNIT_SHARDED}
_SHARD_FIELDS = {
    "attn.to_q.weight": ("q",),
    "attn.to_k.weight": ("k",),
    "attn.to_v.weight": ("v",),
    "attn.to_out.0.weight": ("out",),
    "ff.net.0.proj.weight": ("hidden", "gate"),
    "ff.net.2.weight": ("down",),
    "adaln_proj.linear.weight": ("adaln_w",),
    "adaln_proj.linear.bias": ("adaln_b",),
}
assert tuple(_SHARD_FIELDS) == UNIT_SHARDED


def shard_shapes(config: H3Config, units: range) -> dict[str, tuple[int, ...]]:
    """The shape of each unit-sharded parameter's shard for a rank holding `units`."""
    n, D = len(units), config.hidden_size
    A8, F8, G8 = config.inner_dim // NUM_UNITS, config.ffn_dim // NUM_UNITS, config.adaln_dim // NUM_UNITS
    return {
        "attn.to_q.weight": (n * A8, D),
        "attn.to_k.weight": (n * A8, D),
        "attn.to_v.weight": (n * A8, D),
        "attn.to_out.0.weight": (D, n * A8),
        "ff.net.0.proj.weight": (2 * n * F8, D),
        "ff.net.2.weight": (D, n * F8),
        "adaln_proj.linear.weight": (n * G8, config.time_embed_dim),
        "adaln_proj.linear.bias": (n * G8,),
    }


def unit_shards(weights: BlockWeights, units: range) -> dict[str, Tensor]:
    """The shard of each unit-sharded parameter a rank holding `units` keeps (views of `weights`, but
    ff.net.0.proj.weight's hidden and gate rows, which are joined: a new tensor)."""
    local = unit_weights(weights, units).local
    return {p: local[f[0]] if len(f) == 1 else torch.cat([local[x] for x in f]) for p, f in _SHARD_FIELDS.items()}


def shard_unit_weights(config: H3Config, tensors: dict[str, Tensor], units: range) -> UnitWeights:
    """Views of a rank's block tensors for its canonical units: the replicated ones whole, the
    unit-sharded ones as `unit_shards` lays them out (what `unit_weights` gives from the full block).

    Raises:
        ValueError: a missing tensor, or a shard of another shape than `shard_shapes(config, units)`.
    """
    if not units or units.start < 0 or units.stop > NUM_UNITS or units.step != 1:
        raise ValueError(f"units {units} must be a contiguous sub-range of range({NUM_UNITS})")
    want = shard_shapes(config, units)
    for name in (*REPLICATED, *UNIT_SHARDED):
        if name not in tensors:
            raise ValueError(f"block shards: missing {name!r}; allowed: every parameter of the block")
        if name in want and tuple(tensors[name].shape) != want[name]:
            raise ValueError(f"{name}: shard shape {list(tensors[name].shape)}; allowed: {list(want[name])}")
    A8, F8, G8 = config.inner_dim // NUM_UNITS, config.ffn_dim // NUM_UNITS, config.adaln_dim // NUM_UNITS
    up = tensors["ff.net.0.proj.weight"]
    local = {f[0]: tensors[p] for p, f in _SHARD_FIELDS.items() if len(f) == 1}
    local |= {"hidden": up[: len(units) * F8], "gate": up[len(units) * F8 :]}
    rows = lambda t, n, u: t[(u - units.start) * n : (u - units.start + 1) * n]  # noqa: E731
    cols = lambda t, n, u: t[:, (u - units.start) * n : (u - units.start + 1) * n]  # noqa: E731
    per = {"q": A8, "k": A8, "v": A8, "out": A8, "hidden": F8, "gate": F8, "down": F8, "adaln_w": G8, "adaln_b": G8}
    split = {f: {u: (cols if f in ("out", "down") else rows)(local[f], per[f], u) for u in units} for f in per}
    return UnitWeights(config=config, units=units, replicated={k: tensors[k] for k in REPLICATED}, **split, local=local)


def join_shards(name: str, parts: list[Tensor]) -> Tensor:
    """A unit-sharded parameter `name` whole from the shards of contiguous unit ranges that cover the
    eight units, in unit order (`unit_shards`' layout; ff.net.0.proj.weight: hidden rows, then gate rows).

    Raises:
        ValueError: `name` is not unit-sharded.
    """
    if name not in UNIT_SHARDED:
        raise ValueError(f"{name!r} is not unit-sharded; allowed: {list(UNIT_SHARDED)}")
    if name != "ff.net.0.proj.weight":
        return torch.cat(parts, dim=SHARD_DIM[name])
    halves = [p.chunk(2) for p in parts]
    return torch.cat([h for h, _ in halves] + [g for _, g in halves])
