"""`BlockWeights`: one block's parameters under their diffusers names, with the config they belong to.

The canonical block reads weights only through this mapping; layouts slice it per canonical unit
from the outside (h3lab.sharding) and never change its tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.batch import derived_seed
from h3lab.config import H3Config, block_param_shapes, model_param_shapes, param_dtype


@dataclass(frozen=True, eq=False)
class BlockWeights(Mapping[str, Tensor]):
    """The twelve tensors of one `MiniMaxH3TransformerBlock`, keyed like `attn.to_q.weight`."""

    config: H3Config
    tensors: dict[str, Tensor]
    source: str = "memory"

    def __post_init__(self) -> None:
        want = block_param_shapes(self.config)
        missing = sorted(set(want) - set(self.tensors))
        extra = sorted(set(self.tensors) - set(want))
        if missing or extra:
            raise ValueError(f"block weights from {self.source}: missing {missing}, unexpected {extra}")
        for name, shape in want.items():
            t = self.tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {list(t.shape)}, config expects {list(shape)} ({self.source})")
            if t.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"{name}: dtype {t.dtype}; allowed: bfloat16, float32 ({self.source})")

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the GEMM weights (bf16 in the real checkpoint)."""
        return self.tensors["attn.to_q.weight"].dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> BlockWeights:
        moved = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in self.tensors.items()}
        return BlockWeights(self.config, moved, self.source)


def _tensor_seed(seed: int, name: str) -> int:
    return derived_seed(seed, name) >> 1  # independent of tensor order; 63 bits, as the weights were always drawn


def synthetic_tensor(config: H3Config, name: str, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """One synthetic parameter (full model name), in the real checkpoint's dtype.

    Scales keep activations O(1) through a block: projections ~ N(0, 1/fan_in), RMSNorm weights
    1 + 0.1 N(0, 1), biases 0.1 N(0, 1) / sqrt(fan_in). Each tensor depends only on (seed, name)
    and the generator's device: the CPU stream is what `synthesize_checkpoint` writes; a CUDA
    device draws another deterministic set (Philox) ~500x faster, for real-size chains on GPU.
    """
    shapes = model_param_shapes(config, _num_blocks_in(name))
    if name not in shapes:
        raise ValueError(f"{name!r} is not a parameter of MiniMaxH3Transformer3DModel")
    shape = shapes[name]
    gen = torch.Generator(device).manual_seed(_tensor_seed(seed, name))
    x = torch.randn(shape, generator=gen, device=device)
    if "norm" in name.rsplit(".", 2)[-2] and len(shape) == 1:  # RMSNorm weight
        x = 1.0 + 0.1 * x
    elif name.endswith(".bias"):
        fan_in = shapes[name[: -len("bias")] + "weight"][1]
        x = x * (0.1 / fan_in**0.5)
    else:
        x = x * shape[1] ** -0.5
    return x.to(param_dtype(name))


def _num_blocks_in(name: str) -> int:
    if name.startswith("transformer_blocks."):
        return int(name.split(".")[1]) + 1
    return 0


def synthetic_block(
    config: H3Config, index: int = 0, *, seed: int = 0, device: torch.device | str = "cpu"
) -> BlockWeights:
    """Block `index` of the synthetic checkpoint `synthesize_checkpoint(..., seed=seed)` writes (CPU generator)."""
    prefix = f"transformer_blocks.{index}."
    tensors = {k: synthetic_tensor(config, prefix + k, seed, device) for k in block_param_shapes(config)}
    where = "" if torch.device(device).type == "cpu" else f", {torch.device(device).type} generator"
    return BlockWeights(config, tensors, source=f"synthetic(seed={seed}{where})#block{index}")
