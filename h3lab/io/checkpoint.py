"""Checkpoints in the real diffusers format: synthesize one, load tensors or a block from one.

A folder holds `config.json`, safetensors weights under `MiniMaxH3Transformer3DModel`'s key names
and the real mixed precision (`h3lab.config.param_dtype`), and optionally `manifest.json`
(h3lab.io.manifest) pinning every byte. Loading never unpickles anything, opens only the files that
hold the requested keys, and checks every tensor against the config.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import shutil
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from h3lab.config import H3Config, block_param_shapes, model_param_shapes, param_dtype
from h3lab.io.manifest import (
    CONFIG_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    SINGLE_FILE_NAME,
    Layout,
    dtype_name,
    dump_manifest,
    file_entry,
    find_layout,
    make_manifest,
    open_safetensors,
    read_manifest,
    read_tensor,
    tensor_bytes,
    verify_file,
    verify_tensor,
    write_manifest,
)
from h3lab.metrics import count_nonfinite
from h3lab.weights import BlockWeights, synthetic_tensor

__all__ = ["load_block", "load_tensors", "synthesize_checkpoint", "write_manifest"]

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}  # the two dtypes of param_dtype


# ---- writing ----------------------------------------------------------------------------------
def synthesize_checkpoint(
    path: str | Path,
    config: H3Config,
    *,
    num_blocks: int,
    seed: int,
    max_shard_bytes: int | None = None,
    single_file: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write a synthetic MiniMax-H3 checkpoint folder in the diffusers layout, with `manifest.json`.

    Every tensor is `h3lab.weights.synthetic_tensor(config, name, seed)`. Tensors are generated and
    written one at a time (memory: one tensor, at most 520 MB for the real config). Everything is
    written into a hidden sibling folder that is renamed into place last, so an interrupted run
    leaves no folder that looks complete.

    Args:
        path: the folder to create.
        config: the shape; `num_layers` is replaced by `num_blocks`.
        num_blocks: number of transformer blocks written.
        seed: seed of the synthetic weights.
        max_shard_bytes: diffusers-style greedy shards of at most this many tensor bytes (a larger
            tensor gets a shard of its own). Default: one shard of non-block tensors plus one per block.
        single_file: one `diffusion_pytorch_model.safetensors` and no index.
        overwrite: replace a non-empty existing folder.

    Returns:
        `path` as a Path.

    Raises:
        ValueError: a bad argument, or `path` exists, is not empty and `overwrite` is False.
    """
    _check_synthesis_args(num_blocks, max_shard_bytes, single_file)
    target = Path(path)
    _check_target(target, overwrite)

    config = config.replace(num_layers=num_blocks)
    shapes = model_param_shapes(config)
    groups = _shard_groups(shapes, max_shard_bytes, single_file)
    names = [SINGLE_FILE_NAME] if len(groups) == 1 else [_shard_name(k, len(groups)) for k in range(len(groups))]

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        _write_checkpoint(tmp, config, seed, shapes, dict(zip(names, groups, strict=True)))
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _check_synthesis_args(num_blocks: int, max_shard_bytes: int | None, single_file: bool) -> None:
    """Raises ValueError unless num_blocks >= 1, max_shard_bytes >= 1 or None, and not both sharding options."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ValueError(f"num_blocks {num_blocks!r}; allowed: an int >= 1")
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes {max_shard_bytes!r}; allowed: an int >= 1, or None")
    if single_file and max_shard_bytes is not None:
        raise ValueError(f"single_file=True with max_shard_bytes={max_shard_bytes}; allowed: one of them, or neither")


def _check_target(target: Path, overwrite: bool) -> None:
    """Raises ValueError unless `target` is absent, an empty folder, or a folder `overwrite` may replace."""
    if target.exists() and not target.is_dir():
        raise ValueError(f"{str(target)!r} exists and is not a folder; allowed: a folder path, new or existing")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(
            f"{str(target)!r} is not empty; allowed: a new or empty folder, or overwrite=True to replace it"
        )


def _write_checkpoint(
    tmp: Path, config: H3Config, seed: int, shapes: dict[str, tuple[int, ...]], shards: dict[str, list[str]]
) -> None:
    """Write config.json, the shards (file name -> keys, in order), the index when sharded, then manifest.json."""
    config_json = config.to_diffusers_json()
    _write_json(tmp / CONFIG_NAME, config_json)
    files = {CONFIG_NAME: file_entry(tmp / CONFIG_NAME)}
    tensors: dict[str, dict[str, Any]] = {}
    for file, keys in shards.items():
        specs = {k: (shapes[k], param_dtype(k)) for k in keys}
        files[file] = _write_safetensors(tmp / file, specs, lambda k: synthetic_tensor(config, k, seed), tensors)
    if len(shards) > 1:
        total = sum(_nbytes(shapes[k], param_dtype(k)) for k in shapes)
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        files[INDEX_NAME] = file_entry(tmp / INDEX_NAME)
    dump_manifest(make_manifest(files, tensors, config_json), tmp / MANIFEST_NAME)


def _shard_groups(
    shapes: dict[str, tuple[int, ...]], max_shard_bytes: int | None, single_file: bool
) -> list[list[str]]:
    if single_file:
        return [list(shapes)]
    if max_shard_bytes is None:  # non-block tensors first, then one group per block
        by_block: dict[str, list[str]] = {"": []}
        for key in shapes:
            block = key.split(".")[1] if key.startswith("transformer_blocks.") else ""
            by_block.setdefault(block, []).append(key)
        return list(by_block.values())
    groups: list[list[str]] = [[]]
    size = 0
    for key, shape in shapes.items():  # huggingface_hub's greedy split, counting tensor bytes only
        n = _nbytes(shape, param_dtype(key))
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    return groups


def _shard_name(k: int, n: int) -> str:
    return f"diffusion_pytorch_model-{k + 1:05d}-of-{n:05d}.safetensors"  # 5 digits, as diffusers writes


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")  # diffusers' own formatting


def _write_safetensors(
    path: Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    make: Callable[[str], Tensor],
    tensors: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Stream a safetensors file one tensor at a time; add each tensor's manifest entry to `tensors`.

    The header is known from `specs` before any tensor exists. Tensor order and header bytes are
    those of `safetensors.torch.save_file` (F32 before BF16, then by name; header padded with spaces
    to 8 bytes), so the file is byte-identical to what safetensors itself would write.
    """
    order = sorted(specs, key=lambda k: (specs[k][1] != torch.float32, k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in order:
        shape, dtype = specs[key]
        end = offset + _nbytes(shape, dtype)
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    file_hash = hashlib.sha256()
    with path.open("wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            file_hash.update(chunk)
        for key in order:
            t = make(key)
            assert (tuple(t.shape), t.dtype) == specs[key], f"{key}: generated {t.dtype} {list(t.shape)}"
            data = tensor_bytes(t)
            f.write(data)
            file_hash.update(data)
            tensors[key] = {"file": path.name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            tensors[key]["sha256"] = hashlib.sha256(data).hexdigest()
    size = 8 + len(raw) + offset
    assert path.stat().st_size == size, f"{path}: wrote {path.stat().st_size} bytes, header promises {size}"
    return {"sha256": file_hash.hexdigest(), "size": size}


def _move_into_place(tmp: Path, target: Path) -> None:
    if target.exists():  # the old folder goes only once the new one is complete
        old = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)
    else:
        tmp.rename(target)


# ---- reading ----------------------------------------------------------------------------------
def load_tensors(
    path: str | Path, names: Iterable[str], *, dtype: torch.dtype | None = None, verify: bool = True
) -> dict[str, Tensor]:
    """Load the named tensors of a checkpoint folder, opening only the files that hold them.

    Args:
        path: a checkpoint folder (ours or diffusers' `save_pretrained`), or a repo folder holding `transformer/`.
        names: full parameter names, e.g. `transformer_blocks.3.attn.to_q.weight`.
        dtype: cast to this dtype after all checks (e.g. torch.float32 for parity studies).
        verify: check files and tensors against `manifest.json` when the folder has one.

    Returns:
        name -> tensor, in the order of `names`.

    Raises:
        ValueError: no safetensors weights (pickle formats are refused), an unreadable or truncated
            file, a missing key, a shape that differs from config.json or a dtype that differs from
            the real checkpoint's, or any mismatch with the manifest.
    """
    if isinstance(names, str):
        raise ValueError(f"names {names!r} is one string; allowed: an iterable of tensor names")
    layout, config, manifest = _open_checkpoint(path, verify)
    return _load(layout, config, manifest, list(dict.fromkeys(names)), dtype)


def load_block(path: str | Path, index: int, *, dtype: torch.dtype | None = None, verify: bool = True) -> BlockWeights:
    """Load transformer block `index` of a checkpoint folder (see `load_tensors`).

    Args:
        path: a checkpoint folder, or a repo folder holding `transformer/`.
        index: the block, 0 <= index < num_layers of the folder's config.json.
        dtype: cast to this dtype after all checks.
        verify: check against `manifest.json` when present.

    Returns:
        The block's twelve tensors, keyed without the `transformer_blocks.{index}.` prefix.

    Raises:
        ValueError: `index` out of range, or any error of `load_tensors`.
    """
    layout, config, manifest = _open_checkpoint(path, verify)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < config.num_layers:
        raise ValueError(
            f"block index {index!r} out of range; allowed: 0..{config.num_layers - 1} "
            f"(num_layers={config.num_layers} in {layout.folder / CONFIG_NAME})"
        )
    prefix = f"transformer_blocks.{index}."
    tensors = _load(layout, config, manifest, [prefix + k for k in block_param_shapes(config)], dtype)
    return BlockWeights(config, {k.removeprefix(prefix): v for k, v in tensors.items()}, source=f"{path}#block{index}")


def _open_checkpoint(path: str | Path, verify: bool) -> tuple[Layout, H3Config, dict | None]:
    layout = find_layout(path)
    manifest = read_manifest(layout.folder) if verify else None
    if manifest is not None:
        for name in layout.meta_files:
            verify_file(manifest, layout.folder / name)
    return layout, H3Config.from_json(layout.folder), manifest


def _load(
    layout: Layout, config: H3Config, manifest: dict | None, names: list[str], dtype: torch.dtype | None
) -> dict[str, Tensor]:
    shapes = model_param_shapes(config)
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in shapes:
            raise ValueError(
                f"{name!r} is not a parameter of MiniMaxH3Transformer3DModel with num_layers={config.num_layers}; "
                f"allowed: a key of h3lab.config.model_param_shapes (blocks 0..{config.num_layers - 1})"
            )
        by_file.setdefault(layout.file_of(name), []).append(name)
    out: dict[str, Tensor] = {}
    for file, keys in by_file.items():  # each file hashed and opened once
        file_path = layout.path_of(file)
        if manifest is not None:
            verify_file(manifest, file_path)
        with open_safetensors(file_path) as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise ValueError(
                        f"{key}: missing from {file_path}; allowed: a file holding every key its layout assigns it"
                    )
                # safe_open hands out views of the file's mmap: a later in-place edit of the file would
                # change them (a truncation would SIGBUS), so checks and caller see a private copy
                t = read_tensor(f, key, file_path).clone()
                _check_against_config(key, t, shapes[key], file_path)
                if manifest is not None:  # also pins the bytes read, whatever happened after the file hash
                    verify_tensor(manifest, key, file, t)
                out[key] = t if dtype is None else t.to(dtype)
    return {name: out[name] for name in names}


def _check_against_config(key: str, t: Tensor, shape: tuple[int, ...], path: Path) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{key}: shape {list(t.shape)} in {path}, config.json expects {list(shape)}")
    want = param_dtype(key)
    if t.dtype != want:
        raise ValueError(
            f"{key}: dtype {dtype_name(t.dtype)} in {path}, the MiniMax-H3 checkpoint stores {dtype_name(want)}"
        )
    bad = count_nonfinite(t)  # strict mode (h3lab.contract, rule 6): weights are finite
    if bad:
        raise ValueError(f"{key}: {bad} values in {path} are NaN or Inf; allowed: finite weights")
