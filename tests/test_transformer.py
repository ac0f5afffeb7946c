"""The whole canonical transformer against diffusers 0.42.1, its determinism and its invariances.

(a) float32 parity: a random `MiniMaxH3Transformer3DModel` (2 refiner blocks, 2-3 blocks) saved by
diffusers' `save_pretrained` in >= 4 shards, read back lazily through `CheckpointWeights(dtype=
float32)`; `transformer_forward` against diffusers' own forward in float32 on the same packed
request (96 rows, 3 timesteps). Metric max_rel = max|ours - diffusers| / max|diffusers| (one
misplaced row shows at full size). Measured over the 4 cases: video <= 3.3e-7, audio <= 4.9e-7;
both sides are float32 (unit roundoff 6e-8) in different operation orders (BLAS vs k-ascending
chains; SLEEF vs correctly rounded exp/sin/cos). Tolerance 1e-5, the block's (>= 20x headroom);
one bf16 rounding anywhere (unit roundoff 2e-3) or a wrong formula misses it by orders of magnitude.

(b) bf16: the mixed-precision checkpoint as shipped (bf16 stack, float32 embedders and heads),
canonical vs diffusers' own mixed-precision model, both against diffusers' model in float64 (whose
sinusoid and RoPE positions stay float32 inside diffusers: ~1e-7, far below bf16's 2e-3). Relative
L2 per output, root mean square over 2 seeds, as tests/test_parity.py does. Measured ratios
ours/diffusers, single seeds 0-5: tiny 0.77..0.87, h16x24 0.76..0.94; RMS over the test's seeds 0
and 1: tiny video 0.79 / audio 0.85, h16x24 0.85 / 0.80. Absolute, tiny seed 0: video 4.1e-3 vs
5.3e-3. The test asks for <= 1.0 (>= 15% headroom for another CPU's bf16 kernels on diffusers' side).
"""

from __future__ import annotations

import ast
import functools
import json
import math
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from diffusers.models.embeddings import get_timestep_embedding
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

from h3lab.backend import get_backend
from h3lab.comm import LocalComm
from h3lab.io.checkpoint import synthesize_checkpoint
from h3lab.metrics import error_stats, ulp_distance
from h3lab.model import (
    CheckpointWeights,
    ModelInputs,
    SyntheticWeights,
    embed,
    gather_sequence,
    model_inputs,
    norm_out_table,
    output_rows,
    project_rows,
    row_timesteps,
    text_stream,
    time_embedding,
    timestep_sinusoid,
    transformer_forward,
)
from h3lab.model.packing import layout_positions
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.reference.parity import model_velocity
from tests.conftest import MODEL_CONFIGS, assert_bitwise, model_in_dtype, random_diffusers_model

INDEX = "diffusion_pytorch_model.safetensors.index.json"
CONFIGS = MODEL_CONFIGS
OUT_RTOL = 1e-5
BF16_SEEDS = (0, 1)
TINY = CONFIGS["tiny"]
BE = get_backend("torch")


def _diffusers(model: MiniMaxH3Transformer3DModel, inputs: ModelInputs) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        video, audio = model_velocity(model, inputs)
    return {"video": video, "audio": audio}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    @functools.cache
    def make(name: str, seed: int) -> tuple[MiniMaxH3Transformer3DModel, Path]:
        model = random_diffusers_model(CONFIGS[name], seed)
        folder = tmp_path_factory.mktemp(f"{name}-{seed}")
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size=total // 4)
        assert len(json.loads((folder / INDEX).read_text())["weight_map"]) == len(list(model.parameters()))
        return model, folder

    return make


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_matches_diffusers_through_save_pretrained(saved, name, seed):
    model, folder = saved(name, seed)
    inputs = model_inputs(CONFIGS[name], seed=1000 + seed)
    ours = transformer_forward(CheckpointWeights(folder, dtype=torch.float32), inputs, backend=BE)
    ref = _diffusers(model_in_dtype(model, torch.float32), inputs)
    for k in ("video", "audio"):
        got = getattr(ours, k)
        assert got.dtype == ref[k].dtype == torch.float32 and got.shape == ref[k].shape, k
        err = error_stats(got, ref[k].double())["max_rel"]
        assert err <= OUT_RTOL, f"{name} seed {seed} {k}: max_rel {err:.3g}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_error_is_no_worse_than_diffusers_bf16(saved, name):
    sq = {"video": [0.0, 0.0], "audio": [0.0, 0.0]}  # output -> [ours, diffusers] rel L2 squared, summed over seeds
    for seed in BF16_SEEDS:
        model, folder = saved(name, seed)
        inputs = model_inputs(CONFIGS[name], seed=100 + seed)
        ours = transformer_forward(CheckpointWeights(folder), inputs, backend=BE)
        theirs = _diffusers(model, inputs)
        fp64 = _diffusers(model_in_dtype(model, torch.float64), inputs)
        for k, acc in sq.items():
            assert getattr(ours, k).dtype == theirs[k].dtype == torch.float32, k  # the heads are float32 on both
            acc[0] += error_stats(getattr(ours, k), fp64[k])["rel_l2"] ** 2
            acc[1] += error_stats(theirs[k], fp64[k])["rel_l2"] ** 2
    for k, (ours_sq, theirs_sq) in sq.items():
        ratio = (ours_sq / theirs_sq) ** 0.5
        assert ratio <= 1.0, f"{name} {k}: canonical bf16 error {ratio:.2f}x diffusers' bf16 error"


# ---- determinism and invariances: synthetic weights of the tiny config, 96 packed rows ----------
@pytest.fixture(scope="module")
def tiny_model():
    weights, inputs = SyntheticWeights(TINY, seed=5), model_inputs(TINY, seed=6)
    return weights, inputs, transformer_forward(weights, inputs, backend=BE)


def test_two_runs_and_a_checkpoint_give_identical_bytes_and_seeds_matter(tmp_path, tiny_model):
    weights, inputs, ref = tiny_model
    seen: dict[str, str] = {}
    again = transformer_forward(
        SyntheticWeights(TINY, seed=5), inputs, trace=lambda n, t, space: seen.update({n: space}) or t, backend=BE
    )
    assert {"embed.temb", "embed.hidden", "block0.norm1", "block1.out", "stack.out", "head.audio"} <= seen.keys()
    assert seen["stack.out"] == "replicated" and seen["block1.out"] == "local"
    path = synthesize_checkpoint(tmp_path / "ckpt", TINY, num_blocks=TINY.num_layers, seed=5)
    from_disk = transformer_forward(CheckpointWeights(path), inputs, backend=BE)  # manifest-verified, block by block
    for out in (again, from_disk):
        assert_bitwise(out.video, ref.video, "video")
        assert_bitwise(out.audio, ref.audio, "audio")
    other = transformer_forward(weights, model_inputs(TINY, seed=7), backend=BE)
    assert not torch.equal(other.video, ref.video) and not torch.equal(other.audio, ref.audio)


def test_packed_order_and_row_order_change_no_bit(tiny_model):
    """Permute the packed sequence (every per-row field and the indices follow) and the video/text row order."""
    weights, inputs, ref = tiny_model
    g = torch.Generator().manual_seed(8)
    perm = torch.randperm(inputs.num_rows, generator=g)  # new row j = old row perm[j]
    new_pos = torch.argsort(perm)
    qv = torch.randperm(inputs.video_rows.shape[0], generator=g)
    qt = torch.randperm(inputs.text_rows.shape[0], generator=g)
    shuffled = inputs.replace(
        **{k: getattr(inputs, k)[perm] for k in ("timestep_indices", "token_tags", "position_ids", "logical_keys")},
        video_rows=inputs.video_rows[qv],
        video_indices=new_pos[inputs.video_indices[qv]],
        text_rows=inputs.text_rows[qt],
        text_indices=new_pos[inputs.text_indices[qt]],
        audio_indices=new_pos[inputs.audio_indices],
        num_condition_video_rows=0,
    )
    out = transformer_forward(weights, shuffled, backend=BE)
    assert_bitwise(out.video, ref.video[qv], "video")
    assert_bitwise(out.audio, ref.audio, "audio")


def test_padding_rows_from_a_rows_shard_are_invisible(tiny_model):
    weights, inputs, ref = tiny_model
    shard = SeqShard(Layout(cp=5), inputs.num_rows)  # pads 96 rows to 100: keys (-1, j), zero contents
    assert shard.padded_rows == 100
    out = transformer_forward(weights, inputs, comm=LocalComm(), rows_shard=shard.pad, backend=BE)
    assert_bitwise(out.video, ref.video, "video")
    assert_bitwise(out.audio, ref.audio, "audio")


def test_gather_sequence_refuses_rows_out_of_order(tiny_model):
    weights, inputs, _ = tiny_model
    emb = embed(weights, inputs, backend=BE)
    assert_bitwise(gather_sequence(emb.batch, LocalComm(), emb.batch), emb.batch.hidden_states)
    for bad in (emb.batch.rows(slice(1, None)), emb.batch.rows(torch.arange(inputs.num_rows).flip(0))):
        with pytest.raises(ValueError, match="rows_shard"):
            gather_sequence(bad, LocalComm(), emb.batch)


def test_pre_and_post_processing_are_row_invariant(tiny_model):
    """Sub-batches of rows give the same bytes; the refiner's rows permute with their keys."""
    weights, inputs, _ = tiny_model
    act = torch.bfloat16
    for module, rows in (("proj_in", inputs.video_rows), ("audio_proj_in", inputs.audio_rows)):
        whole = project_rows(weights, module, rows, act, BE)
        parts = [project_rows(weights, module, rows[i : i + 5], act, BE) for i in range(0, rows.shape[0], 5)]
        assert_bitwise(torch.cat(parts), whole, module)
    temb = time_embedding(weights, inputs.timestep, BE)
    for i in range(inputs.timestep.shape[0]):
        assert_bitwise(time_embedding(weights, inputs.timestep[i : i + 1], BE), temb[i : i + 1], f"temb {i}")
    shift, scale = norm_out_table(weights, temb, BE)
    x = torch.randn(inputs.num_rows, TINY.hidden_size, generator=torch.Generator().manual_seed(9)).to(act)
    whole = output_rows(weights, "proj_out", x, inputs.timestep_indices, shift, scale, backend=BE)
    odd = output_rows(weights, "proj_out", x[1::2], inputs.timestep_indices[1::2], shift, scale, backend=BE)
    assert_bitwise(odd, whole[1::2], "proj_out rows")
    keys = inputs.logical_keys[inputs.text_indices]
    text = text_stream(weights, inputs.text_rows, keys, BE)
    q = torch.randperm(keys.shape[0], generator=torch.Generator().manual_seed(10))
    assert_bitwise(text_stream(weights, inputs.text_rows[q], keys[q], BE), text[q], "refiner")


# ---- what the inputs mean: diffusers' pipeline layout and sinusoid ------------------------------
def _pipeline_functions() -> dict:
    """`build_packed_sequence` / `build_row_timesteps` from diffusers' H3 pipeline source.

    The modular pipeline package imports `transformers` on load, which the parity extra does not
    install; these two static methods and their helpers use only numpy and torch, so they are
    compiled from the file itself.
    """
    path = Path(diffusers.__file__).parent / "modular_pipelines/minimax_h3/before_denoise.py"
    keep = []
    for node in ast.parse(path.read_text()).body:
        constant = isinstance(node, ast.Assign) and all(getattr(t, "id", "").startswith("_ROPE") for t in node.targets)
        if constant or (isinstance(node, ast.FunctionDef) and node.name.startswith("_")):  # grid constants, helpers
            keep.append(node)
        elif isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name in ("build_packed_sequence", "build_row_timesteps"):
                    f.decorator_list = []
                    keep.append(f)
    namespace = {"np": np, "torch": torch}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("keyframe", [True, False])
def test_model_inputs_follow_the_diffusers_pipeline_layout(keyframe):
    fn = _pipeline_functions()
    inputs = model_inputs(TINY, seed=0, keyframe=keyframe, num_text=7, num_frames=6)
    anchors = ("first",) if keyframe else ()
    pos, tags, vi, ai, ti, ncond, _ = fn["build_packed_sequence"](
        torch.ones(7, dtype=torch.long), 6, 8, 12, 6, TINY.patch_size, 2, 2, 0, keyframe_anchors=anchors
    )
    assert_bitwise(inputs.position_ids, pos, "position_ids")
    assert_bitwise(layout_positions(7, 6, (8, 12), 6, TINY.patch_size, keyframe), pos, "layout_positions")
    for ours, theirs in ((inputs.token_tags, tags), (inputs.video_indices, vi), (inputs.audio_indices, ai)):
        assert torch.equal(ours, theirs)
    assert torch.equal(inputs.text_indices, ti) and inputs.num_condition_video_rows == ncond
    # equal values merge: video and audio alike, a keyframe at video_t >= 0.999, everything clean
    for video_t, audio_t in ((0.3, 0.6), (0.6, 0.6), (0.9995, 0.2), (0.999, 0.999), (1.0, 1.0)):
        keyframe_t = max(video_t, 0.999)  # the pipeline's condition timestep, as row_timesteps defaults it
        ts, idx = fn["build_row_timesteps"](vi, ai, ncond, 0, 7, video_t, audio_t, keyframe_t, 1.0)
        ours_ts, ours_idx = row_timesteps(inputs, video_t, audio_t)
        assert_bitwise(ours_ts, ts, f"timestep at {video_t}, {audio_t}")
        assert torch.equal(ours_idx, idx), (video_t, audio_t)


def test_timestep_sinusoid_is_diffusers_up_to_two_ulp():
    """torch's vectorised exp/sin/cos are not correctly rounded, ours are (up to ties).

    Measured: torch's exp is 1 ULP off on 2 of the 128 frequencies of freq_dim 256; that moves the
    angle by 1 ULP, and sin(x) ~ x carries it through, plus each side's own rounding: 2 ULP at most
    (seen on 1 of 16384 values). Every other difference is 1 ULP (4% of the values).
    """
    t = torch.cat([torch.tensor([0.0, 1.0, 0.999, 0.5]), torch.rand(60, generator=torch.Generator().manual_seed(1))])
    for freq_dim in (16, 32, 256):
        ref = get_timestep_embedding(t, freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        ours = timestep_sinusoid(t, freq_dim)
        assert int(ulp_distance(ours, ref).max()) <= 2, freq_dim
    # frequency 0 is exp(0) = 1: columns 0 and 16 are cos(t) and sin(t), correctly rounded from float64
    exact = torch.tensor([[math.cos(x), math.sin(x)] for x in t.double().tolist()], dtype=torch.float64).float()
    assert_bitwise(timestep_sinusoid(t, 32)[:, [0, 16]], exact, "cos(t), sin(t)")


# ---- fail closed ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: {"timestep": i.timestep * 1000}, r"timestep: values .* allowed: \[0, 1\] unscaled"),
        (lambda i: {"token_tags": i.token_tags.clamp(max=2) + 1}, r"token_tags: values span \[1, 3\]"),
        (lambda i: {"audio_indices": i.audio_indices.flip(0) * 0}, "must partition the 96 packed rows"),
        (lambda i: {"logical_keys": i.logical_keys - 1}, "first key < 0 marks padding"),
        (lambda i: {"position_ids": i.position_ids.float()}, r"position_ids: dtype torch.float32; allowed"),
        (lambda i: {"num_condition_video_rows": 73}, r"num_condition_video_rows: 73; allowed: an int in \[0, 72\]"),
        (lambda i: {"video_rows": i.video_rows.bfloat16()}, r"video_rows: dtype torch.bfloat16; allowed"),
        (lambda i: {"position_ids": i.position_ids[:, :2]}, r"position_ids: shape \[96, 2\]; allowed: \[S, 3\]"),
        (lambda i: {"video_rows": i.video_rows[0]}, r"video_rows: shape \[16\]; allowed: 2-D \[rows, channels\]"),
        (lambda i: {"timestep": i.timestep.double()}, r"timestep: torch.float64 \[\d+\]; allowed: 1-D float32"),
        (lambda i: {"token_tags": i.token_tags.int()}, r"token_tags: torch.int32 \[96\]; allowed: int64 \[96\]"),
        (lambda i: {"logical_keys": i.logical_keys[:, :1]}, r"logical_keys: torch.int64 \[96, 1\]; allowed: int64"),
        (
            lambda i: {"logical_keys": i.logical_keys * 0},
            r"logical_keys: keys must be unique, \[0, 0\] is not; allowed: one row",
        ),
        (lambda i: {"video_rows": i.video_rows * float("nan")}, r"video_rows: holds inf or NaN; allowed: finite"),
    ],
)
def test_bad_inputs_fail_naming_the_field(change, message):
    inputs = model_inputs(TINY, seed=0)
    with pytest.raises(ValueError, match=message) as err:
        inputs.replace(**change(inputs))
    assert "; allowed:" in str(err.value) and "\n" not in str(err.value)  # one line, what is allowed named


def test_inputs_that_do_not_fit_the_weights_fail():
    weights = SyntheticWeights(TINY, seed=0)
    inputs = model_inputs(TINY.replace(in_channels=3), seed=0)
    with pytest.raises(ValueError, match="video_rows: 12 channels; the config expects 16"):
        embed(weights, inputs, backend=BE)
    with pytest.raises(ValueError, match=r"block index 2 out of range; allowed: 0..1"):
        weights.block(2)
    with pytest.raises(ValueError, match="is not a non-block parameter"):
        weights.tensor("transformer_blocks.0.norm1.weight")
