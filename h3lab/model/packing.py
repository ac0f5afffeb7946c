"""The packed layout diffusers' MiniMax-H3 t2va / fl2va pipeline builds, and a generator of small requests.

Dimension legend: S packed rows, T distinct timesteps.

[text | keyframe condition rows | target audio (stereo, channel-major) | target video], with the
pipeline's float64 (t, h, w) rotary grid (`MiniMaxH3PrepareLayoutStep.build_packed_sequence`) and
its per-row timesteps (`MiniMaxH3SetTimestepsStep.build_row_timesteps`), both reproduced bit for
bit (tests/test_transformer.py compares them with diffusers' own code).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from h3lab.batch import MODALITY_AUDIO, MODALITY_TEXT, MODALITY_VIDEO
from h3lab.config import H3Config
from h3lab.host import to_device
from h3lab.model.inputs import ModelInputs

KEYFRAME_NOISE_AUG = 0.999  # diffusers `keyframe_noise_aug`: a conditioning anchor sits at t = 0.999
AUDIO_CHANNELS = 2  # stereo, packed channel-major (diffusers MINIMAX_H3_AUDIO_CHANNELS)
# diffusers' rotary grid constants (modular_pipelines/minimax_h3/before_denoise.py)
_ROPE_FRAME_RESCALE = 5.0 / 3.0
_ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
_ROPE_SPATIAL_SCALE = 32


def row_timesteps(
    inputs: ModelInputs,
    video_t: float,
    audio_t: float,
    *,
    condition_video_t: float | None = None,
    condition_audio_t: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(timestep [T], timestep_indices [S]) as diffusers' `build_row_timesteps` assigns them.

    Generated video rows and text rows at `video_t`, generated audio rows at `audio_t`, keyframe
    rows at max(video_t, 0.999) unless given, reference audio rows at 1.0; distinct values sorted.
    """
    S, nv, na = inputs.num_rows, inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    cond_v = max(float(video_t), KEYFRAME_NOISE_AUG) if condition_video_t is None else condition_video_t
    # every row starts at video_t (the text rows keep it: ModelInputs holds >= 1), then each group of
    # rows is set to its value; only the values of non-empty groups occur, so the distinct values and
    # each group's index are known on the host, from counts alone (no read-back of the indices)
    values, groups = [float(video_t)], []
    for value, rows in (
        (cond_v, inputs.video_indices[:nv]),
        (float(audio_t), inputs.audio_indices[na:]),
        (condition_audio_t, inputs.audio_indices[:na]),
    ):
        if rows.numel():
            values.append(float(value))
            groups.append(rows)
    timestep, inverse = torch.unique(torch.tensor(values, dtype=torch.float32), sorted=True, return_inverse=True)
    first, *rest = inverse.tolist()
    indices = torch.full((S,), first, dtype=torch.int64, device=inputs.device)
    for k, rows in zip(rest, groups, strict=True):
        indices.index_fill_(0, rows, k)
    return to_device(timestep.tolist(), torch.float32, inputs.device), indices


def patchify(latents_CFHW: Tensor, patch_size: tuple[int, int, int]) -> Tensor:
    """Video latents [C, F, H, W] -> rows [F/pt * H/ph * W/pw, C*pt*ph*pw], frame-major (diffusers)."""
    pt, ph, pw = patch_size
    C, F, H, W = latents_CFHW.shape
    x = latents_CFHW.reshape(C, F // pt, pt, H // ph, ph, W // pw, pw).permute(1, 3, 5, 0, 2, 4, 6)
    return x.reshape(-1, C * pt * ph * pw).contiguous()


def _spatial_grid(dim: int, patch: int, sqrt_area: float) -> Tensor:
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    grid = np.linspace(left, left + ratio, dim // patch, endpoint=False) * _ROPE_SPATIAL_SCALE  # as diffusers
    return torch.from_numpy(grid).to(torch.float64)


def layout_positions(
    num_text: int,
    num_frames: int,
    latent_hw: tuple[int, int],
    num_audio_latents: int,
    patch_size: tuple[int, int, int],
    keyframe: bool,
) -> Tensor:
    """(t, h, w) float64 [S, 3] of [text | keyframe | audio (channel-major, stereo) | video] (diffusers' grid)."""
    (H, W), (_, ph, pw) = latent_hw, patch_size
    sqrt_area = float(np.sqrt(H * W))
    hg, wg = _spatial_grid(H, ph, sqrt_area), _spatial_grid(W, pw, sqrt_area)
    frame = torch.stack([g.reshape(-1) for g in torch.meshgrid(hg, wg, indexing="ij")], dim=-1)  # [rows/frame, 2]
    na = num_audio_latents * AUDIO_CHANNELS
    text = torch.zeros(num_text, 3, dtype=torch.float64)
    text[:, 0] = torch.arange(num_text, dtype=torch.float64)
    cond = torch.cat([torch.full((frame.shape[0], 1), float(num_text), dtype=torch.float64), frame], 1)
    audio = torch.zeros(na, 3, dtype=torch.float64)
    audio[:, 0] = (float(num_text) + torch.arange(num_audio_latents, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    audio[:num_audio_latents, 2], audio[num_audio_latents:, 2] = float(wg[0]), float(wg[-1])
    per_latent = torch.tensor(_ROPE_FRAMES_PER_LATENT, dtype=torch.float64)  # one IEEE product per frame, as diffusers
    spans = _ROPE_FRAME_RESCALE * per_latent[torch.arange(num_frames) % len(_ROPE_FRAMES_PER_LATENT)]
    times = float(num_text) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    video = torch.cat([times.repeat_interleave(frame.shape[0])[:, None], frame.repeat(num_frames, 1)], 1)
    return torch.cat([text, *([cond] if keyframe else []), audio, video])


def model_inputs_rows(
    config: H3Config,
    num_text: int = 12,
    *,
    num_frames: int = 2,
    latent_hw: tuple[int, int] = (8, 12),
    num_audio_latents: int = 6,
    keyframe: bool = True,
) -> int:
    """The packed rows `model_inputs` builds with these arguments, without building them."""
    _, ph, pw = config.patch_size
    frame = (latent_hw[0] // ph) * (latent_hw[1] // pw)
    return num_text + (num_frames + keyframe) * frame + num_audio_latents * AUDIO_CHANNELS


def model_inputs(
    config: H3Config,
    *,
    seed: int,
    num_text: int = 12,
    num_frames: int = 2,
    latent_hw: tuple[int, int] = (8, 12),
    num_audio_latents: int = 6,
    keyframe: bool = True,
    video_t: float | None = None,
    audio_t: float | None = None,
) -> ModelInputs:
    """A realistic small packed request in the diffusers t2va / fl2va layout (96 rows by default).

    12 text rows, one "first" keyframe of 24 condition rows (8x12 latents, patch 2x2), 6 stereo
    audio latents (12 rows), 2 target frames (48 rows). Draw order, as the pipeline's: keyframe
    latent, video noise, audio noise, then text states and (if not given) the two timesteps.
    Timesteps are 3 distinct values: video t, audio t, the keyframe's max(video t, 0.999).
    """
    for name, v in (("num_text", num_text), ("num_frames", num_frames), ("num_audio_latents", num_audio_latents)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    pt, ph, pw = config.patch_size
    H, W = latent_hw
    if pt != 1 or H % ph or W % pw or min(H // ph, W // pw) < 1:
        raise ValueError(
            f"latent_hw={latent_hw} with patch_size={config.patch_size}; "
            "allowed: patch t = 1, H and W positive multiples of the patch"
        )
    gen = torch.Generator().manual_seed(seed)
    C = config.in_channels
    cond = patchify(torch.randn(C, 1, H, W, generator=gen), config.patch_size) if keyframe else None
    video = patchify(torch.randn(C, num_frames, H, W, generator=gen), config.patch_size)
    audio = torch.randn(num_audio_latents * AUDIO_CHANNELS, config.audio_in_channels, generator=gen)
    text = torch.randn(num_text, config.text_dim, generator=gen)
    vt = float(torch.rand((), generator=gen)) if video_t is None else video_t
    at = float(torch.rand((), generator=gen)) if audio_t is None else audio_t
    nc = 0 if cond is None else cond.shape[0]
    nt, na, nv = num_text, audio.shape[0], video.shape[0]
    S = nt + nc + na + nv
    tags = torch.full((S,), MODALITY_VIDEO, dtype=torch.int64)
    tags[:nt], tags[nt + nc : nt + nc + na] = MODALITY_TEXT, MODALITY_AUDIO
    base = ModelInputs(
        video_rows=video if cond is None else torch.cat([cond, video]),
        audio_rows=audio,
        text_rows=text,
        timestep=torch.zeros(1),
        timestep_indices=torch.zeros(S, dtype=torch.int64),
        token_tags=tags,
        position_ids=layout_positions(nt, num_frames, latent_hw, num_audio_latents, config.patch_size, keyframe),
        video_indices=torch.cat([torch.arange(nt, nt + nc), torch.arange(nt + nc + na, S)]),
        audio_indices=torch.arange(nt + nc, nt + nc + na),
        text_indices=torch.arange(nt),
        logical_keys=torch.stack([torch.zeros(S, dtype=torch.int64), torch.arange(S)], dim=1),
        num_condition_video_rows=nc,
    )
    timestep, indices = row_timesteps(base, vt, at)
    return base.replace(timestep=timestep, timestep_indices=indices)


def shuffle_rows(inputs: ModelInputs, seed: int) -> ModelInputs:
    """The same request with its rows out of key order: the packed sequence permuted (every per-row field
    and the stream indices follow their rows, keys included) and the rows of each stream permuted inside
    the stream; conditioning rows stay first among the video rows, as the pipeline packs them.

    A row keeps its key, so the model's output per key, every loss and every gradient keep their bytes
    (tests/test_model_grads.py). One CPU generator from `seed` draws, in order: the packed permutation,
    the conditioning and the generated video rows' permutations, then the audio's and the text's.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(inputs.num_rows, generator=g)  # new row j = old row perm[j]
    new_pos = torch.argsort(perm).to(inputs.device)
    nc, nv = inputs.num_condition_video_rows, inputs.video_rows.shape[0]
    qv = torch.cat([torch.randperm(nc, generator=g), nc + torch.randperm(nv - nc, generator=g)])
    na = inputs.num_condition_audio_rows
    qa = torch.cat([torch.randperm(na, generator=g), na + torch.randperm(inputs.audio_rows.shape[0] - na, generator=g)])
    qt = torch.randperm(inputs.text_rows.shape[0], generator=g)
    qv, qa, qt, perm = (q.to(inputs.device) for q in (qv, qa, qt, perm))
    per_row = ("timestep_indices", "token_tags", "position_ids", "logical_keys")
    return inputs.replace(
        **{k: getattr(inputs, k)[perm] for k in per_row},
        video_rows=inputs.video_rows[qv],
        video_indices=new_pos[inputs.video_indices[qv]],
        audio_rows=inputs.audio_rows[qa],
        audio_indices=new_pos[inputs.audio_indices[qa]],
        text_rows=inputs.text_rows[qt],
        text_indices=new_pos[inputs.text_indices[qt]],
    )


REQUEST_TEXT_ROWS = 12  # model_inputs' default; one more for an odd row count (request_of_rows)
REQUEST_LATENT_HW = (8, 12)  # model_inputs' default latent frame: 24 rows of patch 1x2x2


def _frame_rows(config: H3Config) -> int:
    """Packed rows of one latent frame of `REQUEST_REQUEST_LATENT_HW` (patch 1 x ph x pw)."""
    _, ph, pw = config.patch_size
    return (REQUEST_LATENT_HW[0] // ph) * (REQUEST_LATENT_HW[1] // pw)


def min_request_rows(config: H3Config) -> int:
    """The fewest packed rows `request_of_rows` builds: text, a keyframe, one target frame, one audio latent."""
    return REQUEST_TEXT_ROWS + 2 * _frame_rows(config) + AUDIO_CHANNELS


def request_of_rows(config: H3Config, rows: int, seed: int) -> ModelInputs:
    """A request of exactly `rows` packed rows in `model_inputs`' layout (its default at 96 rows): 12 text
    rows (13 when `rows` is odd), one keyframe, as many target frames as leave room for at least one
    audio latent, and audio latents (2 rows each) filling the rest.

    Raises:
        ValueError: fewer rows than `min_request_rows(config)`.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < min_request_rows(config):
        raise ValueError(
            f"rows={rows!r}; allowed: an int >= {min_request_rows(config)} (text, keyframe, a frame, audio)"
        )
    per_frame, text = _frame_rows(config), REQUEST_TEXT_ROWS + rows % 2
    rest = rows - text - per_frame  # even; frames and audio share it
    frames = (rest - AUDIO_CHANNELS) // per_frame
    audio = (rest - frames * per_frame) // AUDIO_CHANNELS
    inputs = model_inputs(
        config, seed=seed, num_text=text, num_frames=frames, latent_hw=REQUEST_LATENT_HW, num_audio_latents=audio
    )
    assert inputs.num_rows == rows, (inputs.num_rows, rows)
    return inputs
