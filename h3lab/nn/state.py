"""What `h3lab.parallelize` keeps on a model: its layout, this rank's place in it, the comm, the kernels,
and the clip coefficient on its way to the optimizer; and the registry of parallelized models.

Parameters a rank holds (`ParallelState.params`, diffusers' names and order, `model.named_parameters()`):
every non-block parameter and each block's four norm weights whole; each block's unit-sharded weights
(h3lab.units.UNIT_SHARDED) as the shards of this rank's canonical units (h3lab.units.unit_shards:
its units' rows, or input columns for to_out.0 and ff.net.2; ff.net.0.proj its units' hidden rows,
then their gate rows). Under tp1 the shards are the whole tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from h3lab.backend import Backend
from h3lab.comm import BlockComm
from h3lab.config import BLOCK_PREFIX, H3Config
from h3lab.model.transformer import RowsShard
from h3lab.model.weights import ShardedWeights
from h3lab.parallel.layout import Layout
from h3lab.units import UNIT_SHARDED

STATE_ATTR = "_h3lab"  # the attribute of a parallelized model that holds its ParallelState


@dataclass(frozen=True, eq=False)
class PendingClip:
    """`h3lab.optim.clip_grad_norm_`'s coefficient, applied by the next `h3lab.optim.AdamW.step`
    inside its FP32 update (as h3lab's training step applies it: the gradients keep their bytes)."""

    coef: Tensor  # 0-d float32
    norm: Tensor  # 0-d float32
    grads: dict[str, tuple[Tensor, int]]  # parameter name -> its gradient and version counter at the norm
    names: dict[int, str]  # id of each of the model's parameters at the norm -> its name

    def changed(self, grads: dict[str, Tensor | None]) -> list[str]:
        """The parameters whose gradient is not the one (or not at the version) the norm was taken of."""
        return [
            n
            for n, g in grads.items()
            if (n in self.grads) != (g is not None)
            or (g is not None and (self.grads[n][0] is not g or self.grads[n][1] != g._version))
        ]


@dataclass(eq=False)
class ParallelState:
    layout: Layout
    rank: int
    config: H3Config
    comm: BlockComm
    backend: Backend
    device: torch.device
    rows_shard: RowsShard | None  # None: this rank holds every row (TP without SP or CP)
    names: tuple[str, ...]  # the model's parameters, in `named_parameters` order
    clip: PendingClip | None = None
    # the last forward's and backward's own clocks (model_forward's, model_backward's: the clocks Trainer
    # reports) by the phase they time, read when `timings` is asked for (h3lab.clock), for benchmarks
    laps: dict[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def timings(self) -> dict[str, float]:
        """{"forward_s": ..., "backward_s": ...} of the last forward and backward (what ran of them)."""
        return {phase: lap[phase] for phase, lap in self.laps.items()}

    def params(self, model: nn.Module) -> list[Tensor]:
        """The model's parameters in `names` order.

        Raises:
            ValueError: the model's parameters are no longer the ones parallelized (added, removed, renamed).
        """
        held = dict(model.named_parameters())
        if tuple(held) != self.names:
            extra = sorted(set(held) - set(self.names))[:3]
            raise ValueError(
                f"the model's parameters changed after h3lab.parallelize (new or renamed: {extra}); allowed: "
                "the parameters parallelize left"
            )
        return list(held.values())

    def weights(self, tensors: list[Tensor]) -> ShardedWeights:
        """The model's weights as this rank holds them (the tensors themselves, in `names` order)."""
        return ShardedWeights(self.config, dict(zip(self.names, tensors, strict=True)), self.comm.units)


def split_name(name: str) -> tuple[int | None, str]:
    """(block index, the name inside the block) of a parameter; (None, name) outside the blocks."""
    if not name.startswith(BLOCK_PREFIX):
        return None, name
    index, rest = name.removeprefix(BLOCK_PREFIX).split(".", 1)
    return int(index), rest


def is_sharded(name: str, state: ParallelState) -> bool:
    """Whether this rank holds only its units' shard of parameter `name` (a unit-sharded block weight
    under tp > 1)."""
    block, rest = split_name(name)
    return block is not None and rest in UNIT_SHARDED and state.layout.tp > 1


_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def register(model: nn.Module, state: ParallelState) -> None:
    object.__setattr__(model, STATE_ATTR, state)  # no nn.Module bookkeeping: not a module or parameter
    _MODELS.add(model)


def state_of(model: object) -> ParallelState | None:
    """A parallelized model's state; None for any other object."""
    return model.__dict__.get(STATE_ATTR) if isinstance(model, nn.Module) else None


def require_state(model: object, what: str) -> ParallelState:
    """`state_of(model)`, refusing a model that is not parallelized."""
    state = state_of(model)
    if state is None:
        raise ValueError(
            f"{what}: {type(model).__name__} is not parallelized; allowed: a model h3lab.parallelize returned"
        )
    return state


def parallelized() -> Iterator[tuple[nn.Module, ParallelState]]:
    """Every live parallelized model of this process, with its state."""
    for model in list(_MODELS):
        yield model, model.__dict__[STATE_ATTR]
