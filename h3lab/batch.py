"""`PackedBatch`: one packed MiniMax-H3 request as 2-D rows, plus its upstream gradient.

Dimension legend: S packed rows, D hidden_size, T distinct timesteps, E time_embed_dim.

H3 packs text, video and audio rows into one sequence; every row carries its AdaLN table row
(`adaln_indices = timestep_index * 3 + modality`), its (t, h, w) rotary position and a logical
key. The key, not the physical position, names a row: weight gradients reduce rows in ascending
key order, so any permutation or sharding of the rows gives the same bytes. Rows whose first key
is negative are padding: dropped from every reduction, never an attention key, zero in `out`/`dx`.

Non-finite inputs are refused (the contract's rule 6, h3lab.contract): hidden_states and grad_out
in active rows, temb and position_ids must be finite; padding rows may hold anything.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.checks import Checks
from h3lab.config import NUM_MODALITIES, H3Config
from h3lab.finite import check_counts
from h3lab.ops.rows import first_duplicate_row, has_duplicate_rows

ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
SUPPORTED_DEVICES = ("cpu", "cuda")
MODALITY_VIDEO, MODALITY_TEXT, MODALITY_AUDIO = 0, 1, 2
POSITION_DTYPES = (torch.int64, torch.float64)
# torch.Generator.manual_seed takes [-2**63, 2**64 - 1] and maps a negative seed onto 2**64 + seed:
# seeds are the non-negative half, so one seed names one random stream
SEED_MAX = 2**64 - 1


def check_seed(seed: object, name: str = "seed") -> int:
    """`seed` as an int in [0, SEED_MAX].

    Raises:
        ValueError: not an int, or outside the torch generator's range.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{name}={seed!r}; allowed: an int in [0, 2**64 - 1] (torch.Generator's seeds)")
    return seed


def derived_seed(seed: int, what: str) -> int:
    """The seed of `what` (e.g. "step3", "rows", a parameter's name) in a run seeded `seed`: the first 8
    bytes, little-endian, of sha256(f"h3lab:{seed}:{what}"). sha256, not hash(): stable across
    processes and Python versions; streams of one run do not repeat each other, nor another seed's.

    Raises:
        ValueError: a seed outside [0, 2**64 - 1].
    """
    check_seed(seed)
    return int.from_bytes(hashlib.sha256(f"h3lab:{seed}:{what}".encode()).digest()[:8], "little")


@dataclass(frozen=True, eq=False, kw_only=True)
class PackedBatch:
    """One packed sequence. Validated on construction; raises `ValueError` naming the bad field."""

    hidden_states: Tensor  # [S, D], bf16 (canonical) or fp32 (parity studies)
    temb: Tensor  # [T, E] float32, as the model's time embedder gives it
    adaln_indices: Tensor  # [S] int64 in [0, 3T)
    position_ids: Tensor  # [S, 3] (t, h, w), int64 or float64 (the pipeline's fractional grid; RoPE reads float32)
    logical_keys: Tensor  # [S, 2] int64; first key < 0 marks padding
    # [S, D], dtype of hidden_states: the upstream gradient of the block's backward; a forward-only
    # step passes zeros that hold no memory, torch.zeros((), dtype=...).expand(S, D)
    grad_out: Tensor | None = None

    def __post_init__(self) -> None:
        h, g = self.hidden_states, self.grad_out
        _expect(
            isinstance(g, Tensor),
            "grad_out",
            f"missing ({type(g).__name__}); allowed: a [S, D] tensor of hidden_states' dtype, the "
            "upstream gradient (a forward-only step: torch.zeros((), dtype=...).expand(S, D))",
        )
        _expect(h.ndim == 2, "hidden_states", f"shape {list(h.shape)}; allowed: 2-D [S, hidden]")
        _expect(
            h.dtype in ACTIVATION_DTYPES,
            "hidden_states",
            f"dtype {h.dtype} not allowed; allowed: {list(ACTIVATION_DTYPES)}",
        )
        S, D = h.shape
        _expect(S >= 1, "hidden_states", "0 rows; allowed: at least one row")
        _expect(
            self.temb.ndim == 2 and self.temb.shape[0] >= 1,
            "temb",
            f"shape {list(self.temb.shape)}; allowed: [timesteps, time_embed_dim] with timesteps >= 1",
        )
        _expect(
            self.temb.dtype == torch.float32,
            "temb",
            f"dtype {self.temb.dtype}; allowed: torch.float32 (the time embedder's dtype)",
        )
        _expect(tuple(g.shape) == (S, D), "grad_out", f"shape {list(g.shape)}; allowed: {[S, D]}, hidden_states' shape")
        _expect(g.dtype == h.dtype, "grad_out", f"dtype {g.dtype}; allowed: {h.dtype}, hidden_states' dtype")
        for name, want in (("adaln_indices", (S,)), ("position_ids", (S, 3)), ("logical_keys", (S, 2))):
            t = getattr(self, name)
            allowed = POSITION_DTYPES if name == "position_ids" else (torch.int64,)
            _expect(tuple(t.shape) == want, name, f"shape {list(t.shape)}; allowed: {list(want)}")
            _expect(t.dtype in allowed, name, f"dtype {t.dtype}; allowed: {list(allowed)}")
        devices = {t.device for t in (h, g, self.temb, self.adaln_indices, self.position_ids, self.logical_keys)}
        _expect(
            len(devices) == 1,
            "PackedBatch",
            f"tensors on several devices {sorted(map(str, devices))}; allowed: one device",
        )
        _expect(
            h.device.type in SUPPORTED_DEVICES,
            "PackedBatch",
            f"device {h.device} not supported; allowed: {list(SUPPORTED_DEVICES)}",
        )
        self._check_values()

    def _check_values(self) -> None:
        """adaln_indices within [0, 3T) and the active keys unique, read back together (one host sync),
        then the finiteness (`_check_finite`): refused in that order."""
        rows = 3 * self.temb.shape[0]
        idx, keys = self.adaln_indices, self.logical_keys
        c = Checks()

        def span() -> str:
            lo, hi = torch.stack([idx.min(), idx.max()]).tolist()
            return f"values span [{lo}, {hi}]; allowed: [0, {rows - 1}] (3 modalities x {rows // 3} timesteps)"

        c.device((idx.min() >= 0) & (idx.max() < rows), "adaln_indices", span)
        # padding rows (first key < 0) get distinct keys below every active one: only active rows can clash
        rank = torch.arange(keys.shape[0], device=keys.device)
        keyed = torch.where(self.active[:, None], keys, torch.stack([-1 - rank, rank], dim=1))
        c.device(~has_duplicate_rows(keyed), "logical_keys", self._duplicate_message)
        c.read()
        self._check_finite()

    def _duplicate_message(self) -> str:
        return (
            f"duplicate active key {first_duplicate_row(self.logical_keys[self.active])}; allowed: each active key once"
        )

    def _check_finite(self, fields: tuple[str, ...] = ("hidden_states", "grad_out", "temb", "position_ids")) -> None:
        """NaN or Inf in an input the block reads: refused, with one host sync for all of `fields`
        (none inside `h3lab.finite.deferred_checks()`: its scope's one sync reads them)."""
        active = self.active
        count = {
            "hidden_states": lambda: (~torch.isfinite(self.hidden_states).all(dim=1) & active).sum(),
            "grad_out": lambda: (~torch.isfinite(self.grad_out).all(dim=1) & active).sum(),
            "temb": lambda: (~torch.isfinite(self.temb)).sum(),
            "position_ids": lambda: (~torch.isfinite(self.position_ids)).sum(),
        }
        units = {"hidden_states": "active rows", "grad_out": "active rows", "temb": "values", "position_ids": "values"}

        def verdict(counts: list[int]) -> None:
            for name, n in zip(fields, counts, strict=True):
                _expect(
                    n == 0,
                    name,
                    f"{n} {units[name]} hold NaN or Inf; allowed: finite values (strict mode: the contract's "
                    "bits are defined for finite inputs; padding rows may hold anything)",
                )

        check_counts(torch.stack([count[f]() for f in fields]), verdict)

    def with_rows(self, *, hidden_states: Tensor | None = None, grad_out: Tensor | None = None) -> PackedBatch:
        """This batch with new `hidden_states` and/or `grad_out` (a block's output, an upstream gradient):
        the metadata, checked when this batch was made, is not read again; the new tensors' shapes,
        dtypes and device are checked, and their finiteness (one sync, or none inside
        `h3lab.finite.deferred_checks()`).

        Raises:
            ValueError: a new tensor of another shape, dtype or device than the one it replaces; NaN or
                Inf in its active rows.
        """
        new = {"hidden_states": hidden_states, "grad_out": grad_out}
        given = tuple(k for k, t in new.items() if t is not None)
        for name in given:
            t, old = new[name], getattr(self, name)
            _expect(
                (t.shape, t.dtype, t.device) == (old.shape, old.dtype, old.device),
                name,
                f"{t.dtype} {list(t.shape)} on {t.device}; allowed: {old.dtype} {list(old.shape)} on "
                f"{old.device}, as the tensor it replaces",
            )
        out = object.__new__(PackedBatch)
        for k in FIELDS:
            object.__setattr__(out, k, new.get(k) if new.get(k) is not None else getattr(self, k))
        if given:
            out._check_finite(given)
        return out

    @property
    def num_rows(self) -> int:
        return self.hidden_states.shape[0]

    @property
    def num_timesteps(self) -> int:
        return self.temb.shape[0]

    @property
    def active(self) -> Tensor:
        """[S] bool: rows that are not padding."""
        return self.logical_keys[:, 0] >= 0

    @property
    def device(self) -> torch.device:
        return self.hidden_states.device

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{k: getattr(self, k).to(device) for k in FIELDS})

    def rows(self, index: Tensor | slice) -> PackedBatch:
        """The batch restricted to some rows (per-row tensors sliced together; `temb` kept)."""
        return PackedBatch(temb=self.temb, **{k: getattr(self, k)[index] for k in ROW_FIELDS})


ROW_FIELDS = ("hidden_states", "adaln_indices", "position_ids", "logical_keys", "grad_out")
FIELDS = ("hidden_states", "temb", "adaln_indices", "position_ids", "logical_keys", "grad_out")


def _expect(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def packed_batch(
    config: H3Config,
    rows: int = 264,
    *,
    seed: int,
    padding: int = 0,
    num_timesteps: int = 3,
    dtype: torch.dtype = torch.bfloat16,
) -> PackedBatch:
    """A realistic packed request of `rows` active rows plus `padding` padding rows.

    The packing follows H3's: a text prefix, then video latent frames, each followed by the audio
    rows of its time span, so modalities interleave. Text and the first (conditioning) frame sit
    at timestep 0 (clean), the target video at timestep 1, audio at timestep 2 (with 2 timesteps,
    audio shares timestep 1). Logical keys are (request 0, token index in packed order); padding
    rows carry random contents, key (-1, j) and are appended at the end.
    """
    for name, value, least in (("rows", rows, 1), ("padding", padding, 0), ("num_timesteps", num_timesteps, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:  # True is an int to Python
            raise ValueError(f"{name}={value!r}; allowed: an int >= {least} (a count, not a bool)")
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"dtype {dtype} not allowed; allowed: {list(ACTIVATION_DTYPES)}")
    gen = torch.Generator().manual_seed(check_seed(seed))
    modality, timestep, pos = _pack_layout(rows, num_timesteps)
    S, D = rows + padding, config.hidden_size
    keys = torch.stack([torch.zeros(rows, dtype=torch.int64), torch.arange(rows)], dim=1)
    if padding:
        modality = torch.cat([modality, torch.randint(0, NUM_MODALITIES, (padding,), generator=gen)])
        timestep = torch.cat([timestep, torch.randint(0, num_timesteps, (padding,), generator=gen)])
        pos = torch.cat([pos, torch.randint(0, 64, (padding, 3), generator=gen)])
        pad_keys = torch.stack([torch.full((padding,), -1), torch.arange(padding)], dim=1)
        keys = torch.cat([keys, pad_keys])
    return PackedBatch(
        hidden_states=torch.randn(S, D, generator=gen).to(dtype),
        temb=torch.randn(num_timesteps, config.time_embed_dim, generator=gen),
        adaln_indices=timestep * NUM_MODALITIES + modality,
        position_ids=pos,
        logical_keys=keys,
        grad_out=torch.randn(S, D, generator=gen).to(dtype),
    )


def _pack_layout(rows: int, num_timesteps: int) -> tuple[Tensor, Tensor, Tensor]:
    """(modality [S], timestep index [S], (t, h, w) positions [S, 3]) of an H3-style packing: `max(1, S // 8)`
    text rows (i, 0, 0), then latent frames f of 24 video rows (f, h, w) over a 4 x 6 grid followed by 3
    audio rows (f, 0, a), cut at S rows. Built as tensors: memory and time linear in S."""
    num_text = max(1, rows // 8)
    grid_h, grid_w, audio_per_frame = 4, 6, 3  # 24 video rows then 3 audio rows per latent frame
    per_frame = grid_h * grid_w + audio_per_frame
    frames = -(-max(0, rows - num_text) // per_frame)
    cell, audio = torch.arange(grid_h * grid_w), torch.arange(audio_per_frame)
    one_frame_hw = torch.cat(
        [torch.stack([cell // grid_w, cell % grid_w], 1), torch.stack([torch.zeros_like(audio), audio], 1)]
    )
    one_frame = torch.cat([torch.full_like(cell, MODALITY_VIDEO), torch.full_like(audio, MODALITY_AUDIO)])
    frame = torch.arange(frames).repeat_interleave(per_frame)  # the latent frame of every frame row
    frame_modality = one_frame.repeat(frames)
    video_t = (frame > 0).long()  # the first frame conditions (timestep 0), the others are generated
    frame_t = torch.where(frame_modality == MODALITY_VIDEO, video_t, min(2, num_timesteps - 1))
    text = torch.arange(num_text)
    modality = torch.cat([torch.full_like(text, MODALITY_TEXT), frame_modality])
    timestep = torch.cat([torch.zeros_like(text), frame_t])
    text_pos = torch.stack([text, torch.zeros_like(text), torch.zeros_like(text)], 1)
    pos = torch.cat([text_pos, torch.cat([frame[:, None], one_frame_hw.repeat(frames, 1)], 1)])
    return modality[:rows], timestep[:rows], pos[:rows]
