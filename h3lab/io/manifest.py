"""A checkpoint folder on disk: where its safetensors weights are, and the sha256 manifest that pins them.

`manifest.json` (format `h3lab-manifest-v1`) records sha256 and size of every file the loader opens
(config.json, the index, each weight file) and dtype, shape and sha256 of every tensor's raw
little-endian bytes. File hashes catch a tampered or truncated shard before it is parsed; tensor
hashes pin the bytes actually handed to the caller.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from h3lab.io.jsonfile import write_json

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "h3lab-manifest-v1"
CONFIG_NAME = "config.json"
SINGLE_FILE_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFDIR: "folder",
}


# ---- regular files only -----------------------------------------------------------------------
# A checkpoint folder is read as files: a FIFO would block its reader until some writer came, a
# device or a socket would never end or not be the bytes pinned. Links are followed (a hub cache
# links its blobs); what they point to must be a regular file.
def check_regular(path: str | Path) -> None:
    """Refuse `path` if it exists and is not a regular file (through links); a missing path passes.

    Raises:
        ValueError: naming the path and what it is.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is a {_kind(mode)}, not a regular file; allowed: regular files")


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for binary reading, refusing anything but a regular file without waiting on it
    (O_NONBLOCK: a FIFO opens at once, then is refused).

    Raises:
        ValueError: not a regular file. OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is a {_kind(mode)}, not a regular file; allowed: regular files")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "special file")


@dataclass(frozen=True)
class Layout:
    """Where a checkpoint's weights live: one safetensors file, or shards listed by an index."""

    folder: Path
    files: tuple[str, ...]  # weight files, in first-use order
    weight_map: dict[str, str] | None  # key -> file; None: the one file holds every key
    index: str | None = None

    @property
    def meta_files(self) -> tuple[str, ...]:
        """The small files every load reads: config.json and, when sharded, the index."""
        return (CONFIG_NAME,) if self.index is None else (CONFIG_NAME, self.index)

    def file_of(self, key: str) -> str:
        if self.weight_map is None:
            return self.files[0]
        if key not in self.weight_map:
            raise ValueError(f"{key}: missing from the checkpoint (not in {self.folder / self.index})")
        return self.weight_map[key]

    def path_of(self, file: str) -> Path:
        path = self.folder / file
        check_regular(path)
        if not path.is_file():
            raise ValueError(f"weight file {str(path)!r} is missing")
        return path


def find_layout(path: str | Path) -> Layout:
    """The weights of the checkpoint folder `path` (or of its `transformer/` subfolder, the repo layout)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint path {str(folder)!r} is not a folder")
    if not os.path.lexists(folder / CONFIG_NAME) and (folder / "transformer").is_dir():
        folder = folder / "transformer"  # MiniMax-H3's repo keeps the transformer in a subfolder
    entries = sorted(p.name for p in folder.iterdir())
    for name in entries:  # every file a load reads, refused before anything opens it
        if name in (CONFIG_NAME, MANIFEST_NAME) or name.endswith((".safetensors", ".safetensors.index.json")):
            check_regular(folder / name)
    names = [n for n in entries if (folder / n).is_file()]
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    singles = [n for n in names if n.endswith(".safetensors")]
    if indexes:
        index = INDEX_NAME if INDEX_NAME in indexes else _only(indexes, folder, "indexes")
        weight_map = _read_weight_map(folder / index)
        return Layout(folder, tuple(dict.fromkeys(weight_map.values())), weight_map, index)
    if singles:
        single = SINGLE_FILE_NAME if SINGLE_FILE_NAME in singles else _only(singles, folder, "unindexed files")
        return Layout(folder, (single,), None)
    pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
    if pickles:
        raise ValueError(
            f"{str(folder)!r} holds only pickle-based weights {pickles}; only safetensors is supported "
            "(a pickle can run code when loaded, so h3lab never loads one)"
        )
    raise ValueError(f"no safetensors weights in {str(folder)!r}; expected {SINGLE_FILE_NAME} or {INDEX_NAME}")


def _only(candidates: list[str], folder: Path, what: str) -> str:
    if len(candidates) > 1:
        raise ValueError(f"{str(folder)!r} holds several safetensors {what} {candidates}; keep one")
    return candidates[0]


def _read_weight_map(index: Path) -> dict[str, str]:
    raw = _read_json(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no weight_map (a non-empty {{key: file}} object)")
    for key, file in weight_map.items():
        # a file name, never a path: an index must not point outside its folder
        if not isinstance(file, str) or Path(file).name != file or file in (".", ".."):
            raise ValueError(f"{index}: {key} maps to {file!r}; allowed: a file name in the same folder")
    return weight_map


def _read_json(path: Path) -> Any:
    try:
        with open_regular(path) as f:
            return json.loads(f.read().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err


# ---- safetensors reading, with errors that name the file ----------------------------------------
@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open(path)` (lazy, mmap; never a pickle); a corrupt or truncated file is a ValueError."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from err
    with handle as f:
        yield f


def read_tensor(f: Any, key: str, path: Path) -> Tensor:
    try:
        return f.get_tensor(key)
    except SafetensorError as err:
        raise ValueError(f"{path}: cannot read tensor {key} ({err})") from err


# ---- hashing ----------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    """sha256 of a file, streamed (hashlib reads 256 KiB at a time), so a 1.3 GB shard costs no memory."""
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tensor_bytes(t: Tensor) -> Any:
    """The tensor's raw little-endian bytes as a uint8 array (what safetensors stores)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_entry(file: str, t: Tensor, sha256: str | None = None) -> dict[str, Any]:
    """The manifest record of one tensor; `sha256` when the caller already hashed its bytes."""
    digest = sha256 or hashlib.sha256(tensor_bytes(t)).hexdigest()
    return {"file": file, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": digest}


# ---- the manifest -----------------------------------------------------------------------------
def make_manifest(files: dict[str, dict[str, Any]], tensors: dict[str, dict[str, Any]], config: dict) -> dict:
    return {"format": MANIFEST_FORMAT, "files": files, "tensors": tensors, "config": config}


def dump_manifest(manifest: dict, out: Path) -> None:
    """Write atomically: a reader never sees half a manifest."""
    write_json(out, manifest, sort_keys=True)


def manifest_path(path: str | Path, out: str | Path | None = None) -> Path:
    """Where `write_manifest(path, out)` writes: `out`, else manifest.json beside the weights.

    Raises:
        ValueError: what `find_layout` refuses, or a target that exists and is not a regular file.
    """
    target = find_layout(path).folder / MANIFEST_NAME if out is None else Path(out)
    check_regular(target)  # an existing manifest is read before it is replaced: a FIFO would block
    return target


def write_manifest(path: str | Path, out: str | Path | None = None, *, force: bool = False) -> Path:
    """Pin an existing checkpoint: sha256 of every file it loads from and of every tensor.

    Files are hashed in streamed chunks and tensors one at a time through `safe_open`, so memory
    stays at one tensor (520 MB for the real AdaLN weight) even for the 66 GB real checkpoint.
    An existing manifest is replaced only when it pins exactly what the files hold now, or with
    `force`: re-pinning changed files would accept a tampered or truncated shard silently.

    Args:
        path: the checkpoint folder (or the repo folder holding `transformer/`).
        out: where to write; default `manifest.json` next to the weights, where loaders look for it.
        force: replace an existing manifest whose pins no longer match the files (or that is unreadable).

    Returns:
        The path of the manifest written.

    Raises:
        ValueError: no safetensors weights, an unreadable file, a key the index maps to a file
            without it, or (without `force`) an existing manifest whose pins differ from the files.
    """
    target = manifest_path(path, out)
    manifest = _pin(find_layout(path))
    if target.exists() and not force:
        try:
            changes = manifest_changes(_read_json(target), manifest)
        except (ValueError, AttributeError):
            changes = [f"{target} is not a readable manifest"]
        if changes:
            shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
            raise ValueError(
                f"{target} pins other bytes than the files hold now ({shown}); re-pinning would accept them "
                "unchecked. allowed: restore the files, or re-pin them knowingly with --force"
            )
    dump_manifest(manifest, target)
    return target


def manifest_changes(old: dict, new: dict) -> list[str]:
    """What `new` pins differently from `old`: files and tensors added, removed or changed, and the config."""
    changes = []
    for part, what in (("files", "file"), ("tensors", "tensor")):
        before, after = old.get(part) or {}, new.get(part) or {}
        for key in sorted(set(before) | set(after)):
            if key not in after:
                changes.append(f"{what} {key} removed")
            elif key not in before:
                changes.append(f"{what} {key} added")
            elif before[key] != after[key]:
                was, now = before[key].get("sha256", "?"), after[key].get("sha256", "?")
                changes.append(f"{what} {key} sha256 {was[:12]}.. -> {now[:12]}..")
    if old.get("config") != new.get("config"):
        changes.append("config.json changed")
    return changes


def _pin(layout: Layout) -> dict:
    """The manifest of a checkpoint's files as they are now."""
    files = {name: file_entry(layout.folder / name) for name in layout.meta_files}
    tensors: dict[str, dict[str, Any]] = {}
    for file in layout.files:
        file_path = layout.path_of(file)
        files[file] = file_entry(file_path)
        with open_safetensors(file_path) as f:
            present = set(f.keys())
            keys = present if layout.weight_map is None else [k for k, v in layout.weight_map.items() if v == file]
            for key in sorted(keys):
                if key not in present:
                    raise ValueError(f"{key}: the index maps it to {file_path}, which does not hold it")
                tensors[key] = tensor_entry(file, read_tensor(f, key, file_path))
    return make_manifest(files, tensors, _read_json(layout.folder / CONFIG_NAME))


def file_entry(path: Path) -> dict[str, Any]:
    return {"sha256": file_sha256(path), "size": path.stat().st_size}


def read_manifest(folder: Path) -> dict | None:
    """The folder's `manifest.json`, checked for format; None when there is none."""
    path = folder / MANIFEST_NAME
    check_regular(path)  # a FIFO named manifest.json is refused, never read as "no manifest"
    if not path.is_file():
        return None
    manifest = _read_json(path)
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != MANIFEST_FORMAT:
        raise ValueError(f"{path}: format {found!r}; allowed: {MANIFEST_FORMAT!r}")
    for part in ("files", "tensors", "config"):
        if not isinstance(manifest.get(part), dict):
            raise ValueError(f"{path}: {part!r} must be an object")
    return manifest


def verify_file(manifest: dict, path: Path) -> None:
    """Size, then sha256 (streamed), of one file against its manifest entry."""
    want = manifest["files"].get(path.name)
    if want is None:
        raise ValueError(f"{path}: not pinned by {MANIFEST_NAME}; pinned files: {sorted(manifest['files'])}")
    size = path.stat().st_size
    if size != want.get("size"):  # cheap, and names the usual cause: an interrupted copy
        raise ValueError(f"{path}: size {size} bytes, manifest pins {want.get('size')} (truncated or replaced)")
    digest = file_sha256(path)
    if digest != want.get("sha256"):
        raise ValueError(f"{path}: sha256 {digest}, manifest pins {want.get('sha256')} (contents changed)")


def verify_tensor(manifest: dict, key: str, file: str, t: Tensor) -> None:
    """File, dtype, shape and sha256 of one loaded tensor against its manifest entry."""
    want = manifest["tensors"].get(key)
    if want is None:
        raise ValueError(f"{key}: not pinned by {MANIFEST_NAME}")
    found = tensor_entry(file, t)
    for field in ("file", "dtype", "shape", "sha256"):
        if found[field] != want.get(field):
            raise ValueError(f"{key}: {field} {found[field]}, manifest pins {want.get(field)}")
