"""`ModelInputs`: one packed MiniMax-H3 request as the whole transformer reads it, and a generator.

Dimension legend: S packed rows, Nv video rows, Cv = in_channels * prod(patch_size), Na audio rows,
Ca audio_in_channels, Nt text rows, Ct text_dim, T distinct timesteps.

The fields are the arguments of diffusers' `MiniMaxH3Transformer3DModel.forward` (0.42.1) without
the batch axis (diffusers' batch axis only replicates one layout), plus the row names h3lab's
contract needs (`logical_keys`) and the pipeline's count of leading conditioning rows (which the
model ignores and a denoising trajectory keeps fixed). `model_inputs` builds the layout the
diffusers t2va / fl2va pipeline builds (`MiniMaxH3PrepareLayoutStep.build_packed_sequence`):
[text | keyframe condition rows | target audio | target video], float64 (t, h, w) positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.batch import POSITION_DTYPES
from h3lab.checks import Checks
from h3lab.config import NUM_MODALITIES, H3Config
from h3lab.ops.rows import first_duplicate_row, has_duplicate_rows, key_order
from h3lab.rowplan import host_facts, know_facts

KEY_PARTS = ("video", "audio", "text", "video+audio", "video.generated", "audio.generated")
# the fields a part's key order reads (ModelInputs.key_order)
KEY_FIELDS = frozenset(
    {"logical_keys", "video_indices", "audio_indices", "text_indices"}
    | {"num_condition_video_rows", "num_condition_audio_rows"}
)


@dataclass(frozen=True, eq=False, kw_only=True)
class ModelInputs:
    """One packed request; validated on construction (`ValueError` naming the bad field)."""

    video_rows: Tensor  # [Nv, Cv] float32 patchified latents, in `video_indices` order
    audio_rows: Tensor  # [Na, Ca] float32, in `audio_indices` order
    text_rows: Tensor  # [Nt, Ct] float32 or bf16 text-encoder states, in `text_indices` order
    timestep: Tensor  # [T] float32 distinct values in [0, 1], t = 1 - sigma (1 = clean)
    timestep_indices: Tensor  # [S] int64 into `timestep`
    token_tags: Tensor  # [S] int64: 0 video, 1 text, 2 audio
    position_ids: Tensor  # [S, 3] (t, h, w), int64 or float64
    video_indices: Tensor  # [Nv] int64 packed positions
    audio_indices: Tensor  # [Na] int64
    text_indices: Tensor  # [Nt] int64
    logical_keys: Tensor  # [S, 2] int64, unique, first key >= 0 (padding is a layout's business)
    num_condition_video_rows: int = 0  # leading video rows that condition rather than get generated
    num_condition_audio_rows: int = 0

    def __post_init__(self) -> None:
        """Check the fields in this order; the first that fails raises ValueError naming it. The
        checks of values on the device are read back together, with one host sync (h3lab.checks)."""
        c = Checks()
        self._check_one_device(c)
        S = self._check_positions(c)
        self._check_streams(c)
        self._check_partition(c, S)
        self._check_timestep(c)
        self._check_row_ints(c, S)
        self._check_logical_keys(c, S)
        self._check_condition_counts(c)
        c.read()

    def _check_positions(self, c: Checks) -> int:
        """position_ids is [S, 3], S >= 1, in a POSITION_DTYPES dtype; returns S."""
        S = self.position_ids.shape[0] if self.position_ids.ndim == 2 else -1
        c.host(
            S >= 1 and self.position_ids.shape == (S, 3),
            "position_ids",
            f"shape {list(self.position_ids.shape)}; allowed: [S, 3] with S >= 1",
        )
        c.host(
            self.position_ids.dtype in POSITION_DTYPES,
            "position_ids",
            f"dtype {self.position_ids.dtype}; allowed: {list(POSITION_DTYPES)}",
        )
        return S

    def _check_streams(self, c: Checks) -> None:
        """Each row stream is 2-D, finite, float32 (text also bf16), with one int64 index per row; text has a row."""
        for name, rows_name in (
            ("video_rows", "video_indices"),
            ("audio_rows", "audio_indices"),
            ("text_rows", "text_indices"),
        ):
            rows, idx = getattr(self, name), getattr(self, rows_name)
            c.host(rows.ndim == 2, name, f"shape {list(rows.shape)}; allowed: 2-D [rows, channels]")
            c.host(
                idx.ndim == 1 and idx.dtype == torch.int64,
                rows_name,
                f"{idx.dtype} {list(idx.shape)}; allowed: 1-D int64",
            )
            c.host(
                idx.shape[0] == rows.shape[0],
                rows_name,
                f"{idx.shape[0]} indices for {rows.shape[0]} {name}; allowed: one per row",
            )
            allowed = (torch.float32, torch.bfloat16) if name == "text_rows" else (torch.float32,)
            c.host(rows.dtype in allowed, name, f"dtype {rows.dtype}; allowed: {list(allowed)}")
            finite = lambda rows=rows: torch.isfinite(rows).all()  # noqa: E731
            c.device_once("finite", (rows,), finite, name, lambda: "holds inf or NaN; allowed: finite rows")
        c.host(
            self.text_rows.shape[0] >= 1,
            "text_rows",
            "0 rows; allowed: at least one text row (the text stream sets the dtype)",
        )

    def _check_partition(self, c: Checks, S: int) -> None:
        """The three streams' indices together hold each packed row [0, S) exactly once."""
        streams = (self.text_indices, self.video_indices, self.audio_indices)
        name = "video_indices/audio_indices/text_indices"
        message = f"must partition the {S} packed rows [0, {S}) exactly once; allowed: each row in one stream, once"
        c.host(sum(t.numel() for t in streams) == S, name, message)

        def partition() -> Tensor:
            every = torch.cat(streams)
            return (every.sort().values == torch.arange(S, device=every.device)).all()

        c.device_once(f"partition of {S}", streams, partition, name, lambda: message)

    def _check_timestep(self, c: Checks) -> None:
        """timestep is 1-D float32 [T], T >= 1, its values in [0, 1]."""
        t = self.timestep
        c.host(
            t.ndim == 1 and t.shape[0] >= 1 and t.dtype == torch.float32,
            "timestep",
            f"{t.dtype} {list(t.shape)}; allowed: 1-D float32 [T] with T >= 1",
        )
        c.device_once(
            "in [0, 1]",
            (t,),
            lambda: ((t >= 0) & (t <= 1)).all(),
            "timestep",
            lambda: f"values {t.tolist()}; allowed: [0, 1] unscaled (t = 1 - sigma)",
        )

    def _check_row_ints(self, c: Checks, S: int) -> None:
        """timestep_indices and token_tags are int64 [S] within [0, T - 1] and [0, NUM_MODALITIES - 1]."""
        for name, lo, hi in (
            ("timestep_indices", 0, self.timestep.shape[0] - 1),
            ("token_tags", 0, NUM_MODALITIES - 1),
        ):
            x = getattr(self, name)
            c.host(x.shape == (S,) and x.dtype == torch.int64, name, f"{x.dtype} {list(x.shape)}; allowed: int64 [{S}]")

            def span(x: Tensor = x, lo: int = lo, hi: int = hi) -> str:
                low, high = torch.stack([x.min(), x.max()]).tolist()
                return f"values span [{low}, {high}]; allowed: [{lo}, {hi}]"

            within = lambda x=x, lo=lo, hi=hi: (x.min() >= lo) & (x.max() <= hi)  # noqa: E731
            c.device_once(f"in [{lo}, {hi}]", (x,), within, name, span)

    def _check_logical_keys(self, c: Checks, S: int) -> None:
        """logical_keys is int64 [S, 2], unique, its first key >= 0 (no padding)."""
        k = self.logical_keys
        c.host(
            k.shape == (S, 2) and k.dtype == torch.int64,
            "logical_keys",
            f"{k.dtype} {list(k.shape)}; allowed: int64 [{S}, 2]",
        )
        c.device_once(
            "first keys >= 0",
            (k,),
            lambda: (k[:, 0] >= 0).all(),
            "logical_keys",
            lambda: "first key < 0 marks padding; allowed: first keys >= 0 (model inputs carry no padding)",
        )
        c.device_once(
            "unique",
            (k,),
            lambda: ~has_duplicate_rows(k),
            "logical_keys",
            lambda: f"keys must be unique, {first_duplicate_row(k)} is not; allowed: one row per key",
        )

    def _check_condition_counts(self, c: Checks) -> None:
        """Each conditioning count is an int in [0, that stream's rows]."""
        for name, n in (
            ("num_condition_video_rows", self.video_rows.shape[0]),
            ("num_condition_audio_rows", self.audio_rows.shape[0]),
        ):
            v = getattr(self, name)
            c.host(isinstance(v, int) and 0 <= v <= n, name, f"{v!r}; allowed: an int in [0, {n}]")

    def _check_one_device(self, c: Checks) -> None:
        """Every tensor field lives on one device (first: the other checks compute on several fields)."""
        devices = {f.device for f in self.tensors().values()}
        c.host(
            len(devices) == 1,
            "ModelInputs",
            f"tensors on several devices {sorted(map(str, devices))}; allowed: one device",
        )

    def key_order(self, part: str) -> Tensor:
        """`h3lab.ops.rows.key_order` of one part's logical keys (KEY_PARTS: "video", "audio", "text",
        "video+audio" (video's keys, then audio's), "video.generated" and "audio.generated" (the rows
        after the conditioning ones)): indices into that part's rows in ascending key order. Computed
        once per request: a copy by `replace` that keeps the keys, indices and conditioning counts
        (a noised sample, say) shares them, so a training step sorts no keys after its first.

        Raises:
            ValueError: a part outside KEY_PARTS; duplicate active keys (as key_order).
        """
        if part not in KEY_PARTS:
            raise ValueError(f"key_order part {part!r}; allowed: {list(KEY_PARTS)}")
        orders = self.__dict__.setdefault("_key_orders", {})  # frozen: the cache is not a field
        if part not in orders:
            keys = self.logical_keys
            if part == "video+audio":
                sub = torch.cat([keys[self.video_indices], keys[self.audio_indices]])
            else:
                modality, _, generated = part.partition(".")
                idx = getattr(self, f"{modality}_indices")
                sub = keys[idx[getattr(self, f"num_condition_{modality}_rows") :] if generated else idx]
            orders[part] = key_order(sub)
            if orders[part].numel():  # its row reductions check it from these facts, without a host sync
                know_facts(orders[part], host_facts(orders[part].cpu()))
        return orders[part]

    @property
    def num_rows(self) -> int:
        return self.position_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.position_ids.device

    @property
    def adaln_indices(self) -> Tensor:
        """[S] row of the AdaLN table: timestep_index * 3 + modality tag (diffusers)."""
        return self.timestep_indices * NUM_MODALITIES + self.token_tags

    def tensors(self) -> dict[str, Tensor]:
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)
        }

    def replace(self, **changes: object) -> ModelInputs:
        """A copy with some fields replaced (validated again); it shares the key orders (`key_order`)
        when none of KEY_FIELDS changes."""
        new = dataclasses.replace(self, **changes)
        if "_key_orders" in self.__dict__ and not KEY_FIELDS & changes.keys():
            new.__dict__["_key_orders"] = self.__dict__["_key_orders"]
        return new

    def to(self, device: torch.device | str) -> ModelInputs:
        return self.replace(**{k: v.to(device) for k, v in self.tensors().items()})

    def check_config(self, config: H3Config) -> None:
        """Raises ValueError when the channel counts do not fit `config`."""
        for name, got, want in (
            ("video_rows", self.video_rows.shape[1], config.video_patch_dim),
            ("audio_rows", self.audio_rows.shape[1], config.audio_in_channels),
            ("text_rows", self.text_rows.shape[1], config.text_dim),
        ):
            _expect(got == want, name, f"{got} channels; the config expects {want}")


def _expect(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
