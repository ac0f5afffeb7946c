"""Checkpoints in the diffusers format: synthesize, load, interoperate with diffusers, refuse bad inputs."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import h3lab.io.checkpoint
import h3lab.io.manifest
from h3lab.cli import main
from h3lab.config import H3Config, block_param_shapes, model_param_shapes, param_dtype
from h3lab.io.checkpoint import load_block, load_tensors, synthesize_checkpoint, write_manifest
from h3lab.weights import synthetic_block, synthetic_tensor

NUM_BLOCKS = 3
INDEX = "diffusion_pytorch_model.safetensors.index.json"
SINGLE = "diffusion_pytorch_model.safetensors"
# tiny tensors are 0.4 KB..664 KB (adaln_proj.linear.weight), so 400 KB shards mix packing and oversize tensors
MODES = {"per_block": {}, "by_size": {"max_shard_bytes": 400_000}, "single_file": {"single_file": True}}


@pytest.fixture
def seed() -> int:
    value = secrets.randbelow(2**31 - 1) + 1
    print(f"seed={value}")  # pytest shows it on failure, to reproduce
    return value


@pytest.fixture
def config() -> H3Config:
    return H3Config.tiny().replace(num_layers=NUM_BLOCKS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _shard_of_block(path: Path, index: int) -> Path:
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    return path / weight_map[f"transformer_blocks.{index}.attn.to_q.weight"]


# ---- round trip ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_is_bitwise(tmp_path: Path, config: H3Config, seed: int, mode: str) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed, **MODES[mode])
    assert H3Config.from_json(path) == config
    for index in (0, NUM_BLOCKS - 1):
        block = load_block(path, index)
        want = synthetic_block(config, index, seed=seed)
        assert block.config == config and block.source == f"{path}#block{index}"
        assert list(block) == list(block_param_shapes(config))
        assert all(_bitwise_equal(block[k], want[k]) for k in want), f"block {index} differs ({mode})"
    fp32 = ["proj_in.weight", "time_embedder.linear_2.bias", "audio_proj_out.weight"]
    loaded = load_tensors(path, fp32)
    assert all(_bitwise_equal(loaded[k], synthetic_tensor(config, k, seed)) for k in fp32)
    assert {t.dtype for t in loaded.values()} == {torch.float32}

    files = sorted(p.name for p in path.glob("*.safetensors"))
    if mode == "single_file":
        assert files == [SINGLE] and not (path / INDEX).exists()
        return
    index = json.loads((path / INDEX).read_text())
    shapes = model_param_shapes(config)
    assert set(index["weight_map"]) == set(shapes) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _all_tensors(path).values())
    assert all(f == f"diffusion_pytorch_model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k, f in enumerate(files))
    if mode == "per_block":  # shard 1: every non-block tensor; shard k+2: block k, alone
        assert len(files) == NUM_BLOCKS + 1
        for k in range(NUM_BLOCKS):
            keys = {key for key, f in index["weight_map"].items() if f == files[k + 1]}
            assert keys == {f"transformer_blocks.{k}.{name}" for name in block_param_shapes(config)}
    else:
        for f in files:
            sizes = [t.numel() * t.element_size() for t in safetensors.torch.load_file(path / f).values()]
            assert sum(sizes) <= 400_000 or len(sizes) == 1, f"{f}: {sizes}"


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in path.glob("*.safetensors"):
        out.update(safetensors.torch.load_file(f))
    return out


def test_files_match_safetensors_own_writer_and_cast(tmp_path: Path, config: H3Config, seed: int) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed)
    for f in path.glob("*.safetensors"):
        tensors = safetensors.torch.load_file(f)
        assert f.read_bytes() == safetensors.torch.save(tensors, metadata={"format": "pt"}), f.name
        with safe_open(str(f), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
    bf16, fp32 = load_block(path, 1), load_block(path, 1, dtype=torch.float32)
    assert all(fp32[k].dtype == torch.float32 and torch.equal(fp32[k], bf16[k].float()) for k in bf16)


# ---- interoperability with diffusers --------------------------------------------------------------
def _diffusers_model_class() -> type:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel


def test_diffusers_reads_our_folder(tmp_path: Path, seed: int) -> None:
    config = H3Config.tiny().replace(num_layers=2)
    model_class = _diffusers_model_class()
    # the dtypes we store are exactly those diffusers keeps in float32 (it matches names as substrings)
    for name in model_param_shapes(config):
        keep_fp32 = any(m in name for m in model_class._keep_in_fp32_modules)
        assert (param_dtype(name) == torch.float32) == keep_fp32, name

    class Loader(model_class):
        # diffusers honours _keep_in_fp32_modules only through accelerate, which h3lab does not depend on;
        # without it, it loads each tensor as stored or upcast to float32 (exact for bf16)
        _keep_in_fp32_modules = None

    for mode in MODES.values():
        path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=2, seed=seed, overwrite=True, **mode)
        model, info = Loader.from_pretrained(path, output_loading_info=True)
        assert not any(info.values()), info
        params = dict(model.named_parameters())
        assert set(params) == set(model_param_shapes(config))
        for name, p in params.items():
            ours = synthetic_tensor(config, name, seed)
            assert p.dtype in (ours.dtype, torch.float32), name
            assert _bitwise_equal(p.detach().to(ours.dtype), ours), name


@pytest.mark.parametrize("max_shard_size", ["200KB", None])
def test_we_read_diffusers_save_pretrained(tmp_path: Path, seed: int, max_shard_size: str | None) -> None:
    config = H3Config.tiny().replace(num_layers=2)
    model = _diffusers_model_class()(**config.to_dict())
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # random everywhere (norms init to ones), real dtypes
        p.data = torch.randn(p.shape, generator=gen).to(param_dtype(name))
    repo = tmp_path / "repo"  # the MiniMax-H3 repo layout: the transformer in a subfolder
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(repo / "transformer", **kwargs)
    assert (repo / "transformer" / (INDEX if max_shard_size else SINGLE)).is_file()
    assert not (repo / "transformer" / "manifest.json").exists()

    params = dict(model.named_parameters())
    for index in range(2):
        block = load_block(repo, index)
        assert block.config == config
        prefix = f"transformer_blocks.{index}."
        assert all(_bitwise_equal(block[k], params[prefix + k]) for k in block_param_shapes(config))
    assert _bitwise_equal(load_tensors(repo, ["proj_in.weight"])["proj_in.weight"], params["proj_in.weight"])

    # pin diffusers' folder, then a manifest-verified load sees the same bytes
    manifest = write_manifest(repo)
    assert manifest == repo / "transformer" / "manifest.json"
    assert set(json.loads(manifest.read_text())["tensors"]) == set(params)
    block = load_block(repo, 1)
    assert all(_bitwise_equal(block[k], params[f"transformer_blocks.1.{k}"]) for k in block)


def test_opens_only_the_needed_shards(tmp_path: Path, config: H3Config, seed: int, monkeypatch) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed)
    opened: list[str] = []
    hashed: list[str] = []
    real_open, real_hash = h3lab.io.manifest.safe_open, h3lab.io.manifest.file_sha256
    monkeypatch.setattr(
        h3lab.io.manifest, "safe_open", lambda p, **kw: opened.append(Path(p).name) or real_open(p, **kw)
    )
    monkeypatch.setattr(h3lab.io.manifest, "file_sha256", lambda p: hashed.append(p.name) or real_hash(p))
    load_block(path, 1)
    shard = _shard_of_block(path, 1).name
    assert opened == [shard]
    assert sorted(hashed) == sorted(["config.json", INDEX, shard])  # each at most once
    opened.clear()
    load_tensors(path, ["proj_out.weight", "transformer_blocks.2.norm1.weight", "proj_in.bias"], verify=False)
    non_block = f"diffusion_pytorch_model-00001-of-{NUM_BLOCKS + 1:05d}.safetensors"
    assert opened == [non_block, _shard_of_block(path, 2).name]


# ---- bad inputs -------------------------------------------------------------------------------------
# (*) Bits 0-5 of a byte: a flip there keeps a weight finite (an exponent of all ones needs bit 6 of
# the high byte, for weights below 2), so the load without the manifest reads it; a NaN or Inf
# weight is refused on its own (tests/test_bad_values.py).
def test_flipped_byte_is_caught_by_the_manifest(tmp_path: Path, config: H3Config, seed: int) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed)
    shard = _shard_of_block(path, 1)
    before = load_block(path, 1)
    raw = bytearray(shard.read_bytes())
    raw[-1 - secrets.randbelow(1000)] ^= 1 << secrets.randbelow(6)  # inside the last tensor's data (*)
    shard.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"{shard.name}: sha256 [0-9a-f]{{64}}, manifest pins"):
        load_block(path, 1)
    unchecked = load_block(path, 1, verify=False)  # the header is intact: exactly one tensor changed
    want = synthetic_block(config, 1, seed=seed)
    assert sum(not _bitwise_equal(unchecked[k], want[k]) for k in want) == 1
    assert all(_bitwise_equal(before[k], want[k]) for k in want)  # loaded tensors are copies, not file views
    assert _bitwise_equal(
        load_block(path, 0)["ff.net.2.weight"], synthetic_block(config, 0, seed=seed)["ff.net.2.weight"]
    )


def test_truncated_shard_is_a_value_error(tmp_path: Path, config: H3Config, seed: int) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed)
    shard = _shard_of_block(path, 2)
    raw = shard.read_bytes()
    shard.write_bytes(raw[: -1 - secrets.randbelow(len(raw) // 2)])
    with pytest.raises(ValueError, match=rf"{shard.name}: size \d+ bytes, manifest pins {len(raw)} \(truncated"):
        load_block(path, 2)
    with pytest.raises(ValueError, match=rf"{shard.name}: not a readable safetensors file"):
        load_block(path, 2, verify=False)


def test_edited_manifest_tensor_hash(tmp_path: Path, config: H3Config, seed: int) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed, single_file=True)
    manifest = json.loads((path / "manifest.json").read_text())
    key = "transformer_blocks.0.attn.to_q.weight"
    manifest["tensors"][key]["sha256"] = secrets.token_hex(32)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"{key}: sha256 [0-9a-f]{{64}}, manifest pins"):
        load_block(path, 0)
    assert len(load_block(path, 0, verify=False)) == 12


def _rewrite_single_file(path: Path, edit) -> None:
    tensors = safetensors.torch.load_file(path / SINGLE)
    edit(tensors)
    safetensors.torch.save_file(tensors, path / SINGLE, metadata={"format": "pt"})
    write_manifest(path, force=True)  # a manifest that agrees: the config checks must still refuse


def test_missing_key(tmp_path: Path, config: H3Config, seed: int) -> None:
    path = synthesize_checkpoint(tmp_path / "single", config, num_blocks=NUM_BLOCKS, seed=seed, single_file=True)
    key = "transformer_blocks.1.norm2.weight"
    _rewrite_single_file(path, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=rf"{key}: missing from .*{SINGLE}; allowed: "):
        load_block(path, 1)
    sharded = synthesize_checkpoint(tmp_path / "sharded", config, num_blocks=NUM_BLOCKS, seed=seed)
    index = json.loads((sharded / INDEX).read_text())
    del index["weight_map"][key]
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{key}: missing from the checkpoint \(not in .*{INDEX}"):
        load_block(sharded, 1, verify=False)


def test_wrong_dtype_and_shape(tmp_path: Path, config: H3Config, seed: int) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed, single_file=True)
    key = "transformer_blocks.2.ff.net.2.weight"

    def upcast(t: dict) -> None:
        t[key] = t[key].float()

    _rewrite_single_file(path, upcast)
    with pytest.raises(ValueError, match=rf"{key}: dtype float32 in .*, the MiniMax-H3 checkpoint stores bfloat16"):
        load_block(path, 2)

    def cut(t: dict) -> None:
        t[key] = t[key].bfloat16()[:, :-8].contiguous()

    _rewrite_single_file(path, cut)
    with pytest.raises(ValueError, match=rf"{key}: shape \[192, 504\] in .*, config.json expects \[192, 512\]"):
        load_block(path, 2)
    with pytest.raises(ValueError, match=r"'proj_in.weigth' is not a parameter of .*; allowed: a key of"):
        load_tensors(path, ["proj_in.weigth"])


@pytest.mark.parametrize("index", [-1, NUM_BLOCKS, 1.0])
def test_block_index_out_of_range(tmp_path: Path, config: H3Config, seed: int, index) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed)
    with pytest.raises(ValueError, match=rf"block index {index!r} out of range; allowed: 0\.\.{NUM_BLOCKS - 1}"):
        load_block(path, index)


def test_pickle_weights_are_refused_unread(tmp_path: Path, config: H3Config, seed: int, monkeypatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config.to_diffusers_json()))
    torch.save({"proj_in.weight": torch.randn(3, generator=torch.Generator().manual_seed(seed))}, tmp_path / "w.bin")
    (tmp_path / "w.bin").rename(tmp_path / "diffusion_pytorch_model.bin")

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(
        ValueError, match=r"only pickle-based weights \['diffusion_pytorch_model.bin'\]; only safetensors"
    ):
        load_block(tmp_path, 0)


def test_synthesize_refuses_non_empty_folder(tmp_path: Path, config: H3Config, seed: int) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(
        ValueError, match=rf"'{target}' is not empty; allowed: a new or empty folder, or overwrite=True"
    ):
        synthesize_checkpoint(target, config, num_blocks=2, seed=seed)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    synthesize_checkpoint(target, config, num_blocks=2, seed=seed, overwrite=True)
    assert not (target / "notes.txt").exists() and (target / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left behind


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, "num_blocks 0; allowed: an int >= 1"),
        ({"num_blocks": True}, "num_blocks True; allowed: an int >= 1"),
        ({"max_shard_bytes": 0}, "max_shard_bytes 0; allowed: an int >= 1, or None"),
        ({"single_file": True, "max_shard_bytes": 10}, "single_file=True with max_shard_bytes=10; allowed: one of"),
    ],
)
def test_synthesize_names_a_bad_argument_and_what_is_allowed(
    tmp_path: Path, config: H3Config, seed: int, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        synthesize_checkpoint(tmp_path / "ckpt", config, seed=seed, **({"num_blocks": 2} | kwargs))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder; allowed: a folder path"):
        synthesize_checkpoint(tmp_path / "file", config, num_blocks=2, seed=seed)
    with pytest.raises(ValueError, match="is one string; allowed: an iterable of tensor names"):
        load_tensors(tmp_path, "proj_in.weight")


def test_interrupted_synthesis_leaves_nothing(tmp_path: Path, config: H3Config, seed: int, monkeypatch) -> None:
    def failing(cfg: H3Config, name: str, seed: int) -> torch.Tensor:
        if name.startswith("transformer_blocks.1."):
            raise RuntimeError("disk full")
        return synthetic_tensor(cfg, name, seed)

    monkeypatch.setattr(h3lab.io.checkpoint, "synthetic_tensor", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed)
    assert list(tmp_path.iterdir()) == []


# ---- h3lab manifest -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["per_block", "single_file"])
def test_cli_manifest_equals_synthesized(tmp_path: Path, config: H3Config, seed: int, mode: str, capsys) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed, **MODES[mode])
    written = (path / "manifest.json").read_text()
    assert main(["manifest", str(path), "--out", str(tmp_path / "pinned.json")]) == 0
    assert (tmp_path / "pinned.json").read_text() == written
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and f"{len(model_param_shapes(config))} tensors pinned" in summary[0]
    (path / "manifest.json").unlink()
    assert main(["manifest", str(path)]) == 0
    assert (path / "manifest.json").read_text() == written
    manifest = json.loads(written)
    assert manifest["format"] == "h3lab-manifest-v1" and manifest["config"] == config.to_diffusers_json()
    assert main(["manifest", str(tmp_path / "nowhere")]) == 2


def test_cli_manifest_refuses_to_re_pin_changed_files(tmp_path: Path, config: H3Config, seed: int, capsys) -> None:
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=NUM_BLOCKS, seed=seed)
    pinned = (path / "manifest.json").read_text()
    assert main(["manifest", str(path)]) == 0  # the files match their pins: re-pinning changes nothing
    assert (path / "manifest.json").read_text() == pinned
    shard = _shard_of_block(path, 1)
    raw = bytearray(shard.read_bytes())
    raw[-1 - secrets.randbelow(1000)] ^= 1 << secrets.randbelow(6)  # a tampered shard, same size (*)
    shard.write_bytes(raw)
    capsys.readouterr()
    assert main(["manifest", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"pins other bytes than the files hold now (file {shard.name} sha256" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1 and (path / "manifest.json").read_text() == pinned
    with pytest.raises(ValueError, match="sha256"):
        load_block(path, 1)  # still refused: nothing was re-pinned
    assert main(["manifest", str(path), "--force"]) == 0
    changed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("re-pinned: ")]
    assert changed[0].startswith(f"re-pinned: file {shard.name} sha256") and len(changed) == 2  # the file, one tensor
    assert changed[1].startswith("re-pinned: tensor transformer_blocks.1.")
    assert len(load_block(path, 1)) == 12  # the new pins hold


# ---- regular files only ---------------------------------------------------------------------------
@contextmanager
def _within(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: a reader that opened a FIFO would wait for a writer forever."""

    def expire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s: a FIFO was opened")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_manifest_refuses_a_fifo_config_json_without_waiting_on_it(tmp_path: Path, config: H3Config) -> None:
    """The command that hung: it opened config.json to hash it. In a subprocess, bounded by a timeout."""
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=1, seed=51, single_file=True)
    (path / "config.json").unlink()
    os.mkfifo(path / "config.json")
    for force in ([], ["--force"]):
        res = subprocess.run(
            [sys.executable, "-m", "h3lab", "manifest", str(path), *force], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 2, res.stderr
        assert (
            res.stderr.strip()
            == f"h3lab manifest: error: {path / 'config.json'} is a FIFO, not a regular file; allowed: regular files"
        )


@pytest.mark.parametrize(
    ("name", "kind"),
    [("config.json", "FIFO"), ("manifest.json", "FIFO"), (SINGLE, "FIFO"), (SINGLE, "character device")],
)
def test_every_reader_of_a_checkpoint_refuses_what_is_not_a_regular_file(
    tmp_path: Path, config: H3Config, name: str, kind: str, capsys
) -> None:
    """A FIFO, or a link to a device, named like a checkpoint's file: named, never opened (a FIFO
    manifest.json is not "no manifest", which would load unverified)."""
    path = synthesize_checkpoint(tmp_path / "ckpt", config, num_blocks=1, seed=52, single_file=True)
    (path / name).unlink()
    if kind == "FIFO":
        os.mkfifo(path / name)
    else:
        (path / name).symlink_to("/dev/null")
    refusal = f"{path / name} is a {kind}, not a regular file; allowed: regular files"
    with _within(30):
        with pytest.raises(ValueError) as err:
            load_block(path, 0)
        assert str(err.value) == refusal
        argv = ["run", "--layout", "tp2", "--checkpoint", str(path), "--out", str(tmp_path / "run")]
        assert main(argv) == 2 and capsys.readouterr().err.strip() == f"h3lab run: error: {refusal}"
        assert main(["manifest", str(path), "--force"]) == 2
        assert capsys.readouterr().err.strip() == f"h3lab manifest: error: {refusal}"
    assert not (tmp_path / "run").exists()
