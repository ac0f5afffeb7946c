"""`ModelWeights`: the whole transformer's parameters, handed out block by block.

The real model holds 50 blocks of ~1.3 GB (bf16) each, so a provider never materialises all of
them: `block(i)` loads (or synthesises) one block when the stack reaches it and the caller drops
it after. The non-block tensors (input projections, time MLP, token refiner, norm_out, heads;
about 2 refiner blocks' worth, 1.7 GB real) are read through `tensor(name)`, all at once on first
use (each shard opened and hashed once), and kept, since every forward of a trajectory needs them.
`InMemoryWeights` holds the non-block tensors and the trained blocks in memory instead: a trainer's
optimizer updates them in place between steps. `ShardedWeights` holds what one rank of a layout keeps:
every non-block tensor, each block's replicated tensors and only its units' shards of the rest
(h3lab.units.unit_shards), so a block's tensors come out as that rank's `UnitWeights` (`unit_block`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from h3lab.config import H3Config, block_param_shapes, model_param_shapes
from h3lab.io.manifest import find_layout
from h3lab.units import REPLICATED, UnitWeights, shard_shapes, shard_unit_weights, unit_weights
from h3lab.weights import BlockWeights, synthetic_block, synthetic_tensor


class ModelWeights(Protocol):
    """What the model reads: `config.num_layers` blocks and the named non-block tensors."""

    config: H3Config

    def block(self, index: int) -> BlockWeights:
        """Block `index` (0 <= index < config.num_layers), its twelve tensors."""
        ...

    def tensor(self, name: str) -> Tensor:
        """A non-block parameter by its diffusers name, e.g. `proj_in.weight`."""
        ...


class _Cached:
    config: H3Config

    def __init__(self, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
        self.dtype, self.device = dtype, None if device is None else torch.device(device)
        self._cache: dict[str, Tensor] = {}
        self._names = set(model_param_shapes(self.config, 0))  # non-block names

    def _check_block(self, index: int) -> None:
        n = self.config.num_layers
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
            raise ValueError(f"block index {index!r} out of range; allowed: 0..{n - 1}")

    def tensor(self, name: str) -> Tensor:
        if name not in self._names:
            raise ValueError(f"{name!r} is not a non-block parameter; allowed: {sorted(self._names)}")
        if not self._cache:
            self._cache = {k: self._place(t) for k, t in self._load(sorted(self._names)).items()}
        return self._cache[name]

    def _place(self, t: Tensor) -> Tensor:
        return t.to(device=self.device, dtype=self.dtype or t.dtype)

    def _place_block(self, w: BlockWeights) -> BlockWeights:
        return w if self.dtype is None and self.device is None else w.to(self.device, self.dtype)

    def _load(self, names: list[str]) -> dict[str, Tensor]:
        raise NotImplementedError


class CheckpointWeights(_Cached):
    """A checkpoint folder (ours, or diffusers' `save_pretrained`), read lazily through h3lab.io.checkpoint.

    Every read is checked against config.json and, when present, manifest.json (which hashes the
    block's shard at every `block(i)`; `verify=False` skips that for long trajectories on a
    checkpoint already verified). `dtype` casts after the checks (torch.float32 for parity
    studies; None keeps the checkpoint's mixed precision); `device` is where tensors are handed out.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        verify: bool = True,
    ) -> None:
        self.path, self.verify = Path(path), verify
        self.config = H3Config.from_json(find_layout(path).folder)
        super().__init__(dtype, device)

    def block(self, index: int) -> BlockWeights:
        from h3lab.io.checkpoint import load_block

        self._check_block(index)
        return self._place_block(load_block(self.path, index, verify=self.verify))

    def _load(self, names: list[str]) -> dict[str, Tensor]:
        from h3lab.io.checkpoint import load_tensors

        return load_tensors(self.path, names, verify=self.verify)


class SyntheticWeights(_Cached):
    """The tensors `synthesize_checkpoint(config, seed=seed)` would write, made on demand (no disk)."""

    def __init__(
        self,
        config: H3Config,
        *,
        seed: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        generator: torch.device | str = "cpu",
    ) -> None:
        self.config, self.seed, self.generator = config, seed, torch.device(generator)
        super().__init__(dtype, device)

    def block(self, index: int) -> BlockWeights:
        self._check_block(index)
        return self._place_block(synthetic_block(self.config, index, seed=self.seed, device=self.generator))

    def _load(self, names: list[str]) -> dict[str, Tensor]:
        return {k: synthetic_tensor(self.config, k, self.seed, self.generator) for k in names}


def refiner_tensors(weights: ModelWeights, index: int) -> dict[str, Tensor]:
    """Token-refiner block `index`'s ten tensors, keyed without the `token_refiner.refiner_blocks.{i}.` prefix."""
    n = weights.config.num_refiner_layers
    if not 0 <= index < n:
        raise ValueError(f"refiner block {index} out of range; allowed: 0..{n - 1}")
    prefix = f"token_refiner.refiner_blocks.{index}."
    names = [k for k in model_param_shapes(weights.config, 0) if k.startswith(prefix)]
    return {k.removeprefix(prefix): weights.tensor(k) for k in names}


class InMemoryWeights:
    """Parameters held in memory under their diffusers names: every non-block tensor and some whole
    blocks. The provider a trainer updates in place: `block(i)` and `tensor(name)` hand out the held
    tensors themselves (never copies), so what an optimizer writes into `tensors` is what the next
    step reads. `InMemoryWeights.copy_of(provider, blocks)` materialises another provider's."""

    def __init__(self, config: H3Config, tensors: dict[str, Tensor]) -> None:
        """Raises ValueError naming a tensor that is not a parameter of `config`, is missing (every
        non-block parameter, and each held block whole), has another shape, a dtype other than
        bfloat16 or float32, or holds an inf or NaN (the contract's rule 6, as a checkpoint's)."""
        shapes = model_param_shapes(config)
        unknown = sorted(set(tensors) - set(shapes))
        if unknown:
            raise ValueError(f"not parameters of this config: {unknown[:5]}; allowed: model_param_shapes(config)")
        blocks = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("transformer_blocks.")})
        want = set(model_param_shapes(config, 0))
        want |= {f"transformer_blocks.{i}.{k}" for i in blocks for k in block_param_shapes(config)}
        missing = sorted(want - set(tensors))
        if missing:
            raise ValueError(
                f"missing {missing[:5]} ({len(missing)} in all); allowed: every non-block parameter and whole blocks"
            )
        for name, t in tensors.items():
            if tuple(t.shape) != shapes[name] or t.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(
                    f"{name}: {t.dtype} {list(t.shape)}; allowed: bfloat16 or float32 {list(shapes[name])}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: holds inf or NaN; allowed: finite weights")
        self.config, self.tensors, self.blocks = config, tensors, tuple(blocks)

    @classmethod
    def copy_of(cls, weights: ModelWeights, blocks: Iterable[int]) -> InMemoryWeights:
        """A copy (clones) of `weights`' non-block tensors and of blocks `blocks`."""
        tensors = {k: weights.tensor(k).clone() for k in model_param_shapes(weights.config, 0)}
        for i in blocks:
            tensors |= {f"transformer_blocks.{i}.{k}": t.clone() for k, t in weights.block(i).items()}
        return cls(weights.config, tensors)

    def block(self, index: int) -> BlockWeights:
        """Block `index`'s twelve held tensors."""
        if index not in self.blocks:
            raise ValueError(f"block {index!r} is not held; allowed: {list(self.blocks)}")
        prefix = f"transformer_blocks.{index}."
        return BlockWeights(
            self.config, {k: self.tensors[prefix + k] for k in block_param_shapes(self.config)}, f"memory#block{index}"
        )

    def tensor(self, name: str) -> Tensor:
        """A held non-block parameter by its diffusers name."""
        if name.startswith("transformer_blocks.") or name not in self.tensors:
            raise ValueError(
                f"{name!r} is not a non-block parameter; allowed: {sorted(model_param_shapes(self.config, 0))}"
            )
        return self.tensors[name]


class ShardedWeights:
    """One rank's parameters under their diffusers names: every non-block tensor and each block's
    replicated tensors whole, its unit-sharded tensors as the shards of `units` (h3lab.units.unit_shards).
    The tensors themselves are handed out (views, never copies): what an optimizer writes into them is
    what the next forward reads. No check of values (finiteness is checked where weights enter).
    """

    def __init__(self, config: H3Config, tensors: dict[str, Tensor], units: range) -> None:
        """Raises ValueError naming a tensor that is missing, unexpected, or of another shape than the
        parameter's (a unit-sharded one: its shard's)."""
        shapes = dict(model_param_shapes(config))
        shards = shard_shapes(config, units)
        for i in range(config.num_layers):
            shapes |= {f"transformer_blocks.{i}.{k}": v for k, v in shards.items()}
        missing, unknown = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
        if missing or unknown:
            raise ValueError(
                f"sharded weights: missing {missing[:4]}, unexpected {unknown[:4]}; allowed: the model's parameters"
            )
        for name, t in tensors.items():
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"{name}: shape {list(t.shape)}; allowed: {list(shapes[name])} (units {list(units)})")
        self.config, self.tensors, self.units = config, tensors, units

    def block(self, index: int) -> BlockWeights:
        raise ValueError(
            f"block {index!r}: these weights hold units {list(self.units)} of each block; allowed: unit_block(i, units)"
        )

    def unit_block(self, index: int, units: range) -> UnitWeights:
        """Block `index` as views of its tensors for `units`, which must be the units held."""
        if units != self.units:
            raise ValueError(f"units {list(units)} of block {index}; allowed: the units held, {list(self.units)}")
        if not (isinstance(index, int) and 0 <= index < self.config.num_layers):
            raise ValueError(f"block index {index!r} out of range; allowed: 0..{self.config.num_layers - 1}")
        prefix = f"transformer_blocks.{index}."
        names = (*REPLICATED, *shard_shapes(self.config, units))
        return shard_unit_weights(self.config, {k: self.tensors[prefix + k] for k in names}, units)

    def tensor(self, name: str) -> Tensor:
        """A non-block parameter by its diffusers name."""
        if name.startswith("transformer_blocks.") or name not in self.tensors:
            raise ValueError(
                f"{name!r} is not a non-block parameter; allowed: {sorted(model_param_shapes(self.config, 0))}"
            )
        return self.tensors[name]


def block_units(weights: ModelWeights, index: int, units: range, device: torch.device) -> UnitWeights:
    """Block `index`'s tensors for `units` on `device`: a `ShardedWeights`' own shards (which must be
    on `device` already), or any other provider's block moved there and sliced (h3lab.units.unit_weights)."""
    if isinstance(weights, ShardedWeights):
        uw = weights.unit_block(index, units)
        if uw.replicated["norm1.weight"].device != device:
            raise ValueError(f"block {index}: weights on {uw.replicated['norm1.weight'].device}; allowed: {device}")
        return uw
    w = weights.block(index)
    return unit_weights(w if w["norm1.weight"].device == device else w.to(device), units)
