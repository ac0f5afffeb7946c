"""`H3Config`: the MiniMax-H3 transformer's shape, in diffusers' config names.

Every field is a key of diffusers' `MiniMaxH3Transformer3DModel` config (0.42.1), so a checkpoint's
`config.json` reads straight into an `H3Config` and back. Validation encodes what the determinism
contract needs: 8 canonical reduction units must divide the heads, the SwiGLU width and the AdaLN
columns.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NUM_UNITS = 8  # canonical reduction units of the contract (h3lab.contract re-exports this)
BLOCK_PREFIX = "transformer_blocks."  # a block parameter's diffusers name: BLOCK_PREFIX + "{i}." + its name
NUM_MODALITIES = 3  # 0 video, 1 text, 2 audio: one AdaLN table row per (timestep, modality)
NUM_ADALN_CHUNKS = 6  # shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp

# diffusers `_keep_in_fp32_modules`: these modules are float32 in the real checkpoint, all else bf16.
FP32_MODULE_PREFIXES = ("proj_in.", "audio_proj_in.", "time_embedder.", "proj_out.", "audio_proj_out.")

_DIFFUSERS_ONLY_KEYS = {"_class_name", "_diffusers_version", "_name_or_path"}


@dataclass(frozen=True, kw_only=True)
class H3Config:
    """The shape of a MiniMax-H3 transformer; field names are diffusers' config keys."""

    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(self.patch_size))
        ints = [f.name for f in dataclasses.fields(self) if f.type in ("int", int)]
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"H3Config.{name} must be a positive int, got {value!r}")
        if self.num_refiner_layers < 0:
            raise ValueError(f"num_refiner_layers must be >= 0, got {self.num_refiner_layers}")
        if len(self.patch_size) != 3 or any(not isinstance(p, int) or p < 1 for p in self.patch_size):
            raise ValueError(f"patch_size must be three positive ints, got {self.patch_size!r}")
        for name in ("norm_eps", "qk_norm_eps", "final_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"H3Config.{name} must be a positive number, got {value!r}")
        if self.num_attention_heads % NUM_UNITS:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by the {NUM_UNITS} "
                f"canonical reduction units; allowed: a multiple of {NUM_UNITS} (56 in MiniMax-H3)"
            )
        if self.ffn_dim % NUM_UNITS:
            raise ValueError(
                f"ffn_dim={self.ffn_dim} is not divisible by the {NUM_UNITS} canonical reduction units; "
                f"allowed: a multiple of {NUM_UNITS}"
            )
        if (NUM_ADALN_CHUNKS * NUM_MODALITIES * self.hidden_size) % NUM_UNITS:
            raise ValueError(
                f"hidden_size={self.hidden_size}: the AdaLN projection's 18*hidden_size columns must split "
                f"into {NUM_UNITS} units; allowed: a multiple of 4"
            )
        if 2 * 3 * self.rope_freq_dim > self.attention_head_dim:
            raise ValueError(
                f"rope rotates 2*3*rope_freq_dim={6 * self.rope_freq_dim} channels but "
                f"attention_head_dim={self.attention_head_dim}; allowed: rope_freq_dim <= "
                f"{self.attention_head_dim // 6}"
            )
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim={self.freq_dim} must be even (cos and sin halves)")

    # ---- named configurations ------------------------------------------------------------------
    @classmethod
    def real(cls) -> H3Config:
        """MiniMax-H3 as published (diffusers defaults): 50 blocks, hidden 5376, 56 x 128 heads."""
        return cls()

    @classmethod
    def tiny(cls) -> H3Config:
        """The CPU default: every structural feature of `real()` at about 1/28 of the width.

        8 heads (TP8 holds one each), attention width 256 != hidden 192 (the real ratio 4/3),
        SwiGLU 512 (the real 8/3), partial RoPE (24 of 32 head channels rotated, the real 3/4).
        """
        return cls(
            num_attention_heads=8,
            attention_head_dim=32,
            hidden_size=192,
            num_layers=4,
            num_refiner_layers=2,
            ffn_dim=512,
            in_channels=4,
            audio_in_channels=8,
            patch_size=(1, 2, 2),
            text_dim=64,
            freq_dim=32,
            time_embed_hidden_dim=192,
            time_embed_dim=96,
            rope_freq_dim=4,
        )

    @classmethod
    def named(cls, name: str) -> H3Config:
        """`"tiny"` or `"real"`."""
        if name not in NAMED_CONFIGS:
            raise ValueError(f"unknown configuration {name!r}; allowed: {sorted(NAMED_CONFIGS)}")
        return getattr(cls, name)()

    # ---- diffusers config.json -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> H3Config:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known - _DIFFUSERS_ONLY_KEYS
        if unknown:
            raise ValueError(f"config has keys H3Config does not know: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{k: v for k, v in raw.items() if k in known})

    @classmethod
    def from_json(cls, path: str | Path) -> H3Config:
        """Read a diffusers `config.json` (a file, or the checkpoint folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if path.exists() and not path.is_file():  # a FIFO would block the read below: never opened
            raise ValueError(f"{str(path)!r} is not a regular file; allowed: a config.json file")
        if not path.is_file():
            raise ValueError(f"no config.json at {str(path)!r}")
        try:
            raw = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not JSON ({err}); allowed: a JSON object of config keys") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} holds a JSON {type(raw).__name__}; allowed: a JSON object of config keys")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["patch_size"] = list(self.patch_size)
        return out

    def to_diffusers_json(self) -> dict[str, Any]:
        return {"_class_name": "MiniMaxH3Transformer3DModel", "_diffusers_version": "0.42.1", **self.to_dict()}

    def replace(self, **changes: Any) -> H3Config:
        return dataclasses.replace(self, **changes)

    # ---- derived sizes ------------------------------------------------------------------------
    @property
    def inner_dim(self) -> int:
        """Attention width A = heads * head_dim (7168 in H3, larger than hidden_size)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:
        """Head channels rotated by RoPE: 2 * 3 axes * rope_freq_dim (96 of 128 in H3)."""
        return 6 * self.rope_freq_dim

    @property
    def heads_per_unit(self) -> int:
        return self.num_attention_heads // NUM_UNITS

    @property
    def adaln_dim(self) -> int:
        """Output columns of adaln_proj.linear: 6 chunks x 3 modalities x hidden_size."""
        return NUM_ADALN_CHUNKS * NUM_MODALITIES * self.hidden_size

    @property
    def video_patch_dim(self) -> int:
        p = self.patch_size
        return self.in_channels * p[0] * p[1] * p[2]


NAMED_CONFIGS = ("tiny", "real")


def block_param_shapes(config: H3Config) -> dict[str, tuple[int, ...]]:
    """Parameter names (inside `transformer_blocks.{i}.`) and shapes of one block, diffusers order."""
    D, A, F, E, Dh = (
        config.hidden_size,
        config.inner_dim,
        config.ffn_dim,
        config.time_embed_dim,
        config.attention_head_dim,
    )
    return {
        "norm1.weight": (D,),
        "attn.to_q.weight": (A, D),
        "attn.to_k.weight": (A, D),
        "attn.to_v.weight": (A, D),
        "attn.norm_q.weight": (Dh,),
        "attn.norm_k.weight": (Dh,),
        "attn.to_out.0.weight": (D, A),
        "norm2.weight": (D,),
        "ff.net.0.proj.weight": (2 * F, D),
        "ff.net.2.weight": (D, F),
        "adaln_proj.linear.weight": (config.adaln_dim, E),
        "adaln_proj.linear.bias": (config.adaln_dim,),
    }


def _refiner_block_shapes(config: H3Config) -> dict[str, tuple[int, ...]]:
    shapes = block_param_shapes(config)
    return {k: v for k, v in shapes.items() if not k.startswith("adaln_proj.")}


def model_param_shapes(config: H3Config, num_blocks: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter of a `MiniMaxH3Transformer3DModel` with `num_blocks` blocks (default: num_layers)."""
    n = config.num_layers if num_blocks is None else num_blocks
    D, E = config.hidden_size, config.time_embed_dim
    shapes: dict[str, tuple[int, ...]] = {
        "proj_in.weight": (D, config.video_patch_dim),
        "proj_in.bias": (D,),
        "audio_proj_in.weight": (D, config.audio_in_channels),
        "audio_proj_in.bias": (D,),
        "context_embedder.weight": (D, config.text_dim),
        "context_embedder.bias": (D,),
        "time_embedder.linear_1.weight": (config.time_embed_hidden_dim, config.freq_dim),
        "time_embedder.linear_1.bias": (config.time_embed_hidden_dim,),
        "time_embedder.linear_2.weight": (E, config.time_embed_hidden_dim),
        "time_embedder.linear_2.bias": (E,),
    }
    for j in range(config.num_refiner_layers):
        for k, v in _refiner_block_shapes(config).items():
            shapes[f"token_refiner.refiner_blocks.{j}.{k}"] = v
    shapes["token_refiner.final_norm.weight"] = (D,)
    for i in range(n):
        for k, v in block_param_shapes(config).items():
            shapes[f"transformer_blocks.{i}.{k}"] = v
    shapes.update(
        {
            "norm_out.norm.weight": (D,),
            "norm_out.linear.weight": (2 * D, E),
            "norm_out.linear.bias": (2 * D,),
            "proj_out.weight": (config.video_patch_dim, D),
            "proj_out.bias": (config.video_patch_dim,),
            "audio_proj_out.weight": (config.audio_in_channels, D),
            "audio_proj_out.bias": (config.audio_in_channels,),
        }
    )
    return shapes


def param_dtype(name: str) -> torch.dtype:
    """The real checkpoint's dtype of a parameter: float32 for diffusers' fp32 modules, else bf16."""
    return torch.float32 if name.startswith(FP32_MODULE_PREFIXES) else torch.bfloat16
