"""`Problem`: the block, the batch and the arithmetic a run compares across layouts, as data.

The runner and every worker rebuild the same weights and batch from this record (weights from a
checkpoint or the deterministic synthetic generator, the batch from `packed_batch`, a trajectory's
or a training run's request from `model_inputs`), so nothing but a small JSON travels to the ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from h3lab.backend import CONTRACT_BACKENDS, EMULATED
from h3lab.batch import PackedBatch, check_seed, packed_batch
from h3lab.config import NAMED_CONFIGS, H3Config
from h3lab.model.inputs import ModelInputs
from h3lab.parallel.layout import Layout
from h3lab.train.adamw import AdamWHyper
from h3lab.weights import BlockWeights, synthetic_block

MODES = ("deterministic", "baseline")
TASKS = ("block", "chain", "trajectory", "train")
DEVICES = ("cpu", "cuda")
# a training request's rows: as the pipeline packs them (ascending keys), or permuted out of key order
# (h3lab.model.packing.shuffle_rows, drawn from derived_seed(seed, "rows")); both give the same bytes
ROW_ORDERS = ("packed", "shuffled")
# who draws a chain's, trajectory's or training run's synthetic weights: the run device's generator
# (on a GPU CUDA's Philox: real-size depths in seconds, another set than a CPU's), or the CPU's on
# every device (the set a CPU reproduces, e.g. the emulator of a GPU's bits). Task "block" always
# draws on the CPU.
WEIGHTS_GENERATORS = ("device", "cpu")
_HYPER = AdamWHyper()  # the defaults of the training run's optimizer fields


@dataclass(frozen=True, kw_only=True)
class Problem:
    synthetic: str | None = "tiny"  # a named config with synthetic weights, or None with `checkpoint`
    checkpoint: str | None = None  # a diffusers checkpoint folder
    task: str = "block"  # one block, a chain of blocks, a denoising trajectory or training steps through the model
    block: int = 0  # the block of task "block"; the first block of a chain or of a training run's depth
    last_block: int | None = None  # the last block of a chain or of a training run's depth (inclusive)
    steps: int = 2  # sampler steps of a trajectory; optimizer steps of a training run
    text_rows: int = 12  # text rows of a trajectory's or a training run's request (12: 96 packed rows)
    row_order: str = "packed"  # ROW_ORDERS: a training request's rows
    # a training run's AdamW (h3lab.train.adamw.AdamWHyper: torch.optim.AdamW's defaults, max_grad_norm 1)
    lr: float = _HYPER.lr
    betas: tuple[float, float] = _HYPER.betas
    eps: float = _HYPER.eps
    weight_decay: float = _HYPER.weight_decay
    max_grad_norm: float = _HYPER.max_grad_norm
    weights_seed: int = 0
    weights_generator: str = "device"  # WEIGHTS_GENERATORS
    rows: int = 264
    padding: int = 0
    seed: int = 0
    device: str = "cpu"
    backend: str = "torch"  # kernels of the deterministic mode
    mode: str = "deterministic"
    repeats: int = 1
    # compare weight gradients (a training run's weights too) by digest per unit slice (runs too big to store them)
    digests: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):  # JSON gives a list
            object.__setattr__(self, "betas", tuple(self.betas))
        self.validate()

    def validate(self) -> None:
        """The one validator of a run request: `h3lab run`, the notebooks' parameters
        (h3lab.workbench.params) and every worker build a Problem, and building one calls this. Each
        refusal is one ValueError naming the field, its value and what is allowed."""
        for name in ("rows", "repeats", "steps", "text_rows", "padding", "block"):
            _check_int(name, getattr(self, name))
        if self.last_block is not None:
            _check_int("last_block", self.last_block)
        if (self.synthetic is None) == (self.checkpoint is None):
            raise ValueError("give exactly one of a synthetic config (tiny, real) or a checkpoint folder")
        if self.synthetic is not None and self.synthetic not in NAMED_CONFIGS:
            raise ValueError(f"unknown synthetic config {self.synthetic!r}; allowed: {list(NAMED_CONFIGS)}")
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; allowed: {list(TASKS)}")
        if self.task == "chain" and (self.last_block is None or self.last_block < self.block):
            raise ValueError(f"a chain needs last_block >= block, got blocks {self.block}-{self.last_block}")
        if self.last_block is not None and self.last_block < self.block:
            raise ValueError(f"blocks {self.block}-{self.last_block}; allowed: A-B with A <= B")
        if self.weights_generator not in WEIGHTS_GENERATORS:
            raise ValueError(
                f"unknown weights_generator {self.weights_generator!r}; allowed: {list(WEIGHTS_GENERATORS)}"
            )
        if self.row_order not in ROW_ORDERS:
            raise ValueError(f"unknown row_order {self.row_order!r}; allowed: {list(ROW_ORDERS)}")
        if self.row_order != "packed" and self.task != "train":
            raise ValueError(f"row_order {self.row_order!r} is for task 'train'; allowed for {self.task!r}: ['packed']")
        self.hyper()  # one ValueError per bad optimizer value
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; allowed: {list(MODES)}")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; allowed: {list(DEVICES)}")
        if self.backend not in CONTRACT_BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; allowed: {list(CONTRACT_BACKENDS)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device; allowed here: ['cpu']")
        if self.block_backend == "triton" and self.device != "cuda":
            allowed = ["torch", *EMULATED]
            raise ValueError(f"backend 'triton' runs on CUDA only, device is {self.device!r}; allowed here: {allowed}")
        if self.block_backend in EMULATED and self.device != "cpu":
            raise ValueError(
                f"backend {self.block_backend!r} runs on a CPU, device is {self.device!r}; allowed: --device cpu"
            )
        for name in ("rows", "repeats", "steps", "text_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.padding < 0 or self.block < 0:
            raise ValueError(f"padding={self.padding}, block={self.block}: both must be >= 0")
        check_seed(self.seed, "seed")
        check_seed(self.weights_seed, "weights_seed")
        if self.checkpoint is not None:  # config.json is small: a block past the checkpoint fails here
            layers = self.config().num_layers
            last = self.block_range.stop - 1
            if last >= layers:
                raise ValueError(f"block {last} is past the checkpoint; allowed: 0..{layers - 1} ({self.checkpoint})")

    @property
    def block_backend(self) -> str:
        """The kernels block_step runs: the baseline mode always runs library kernels."""
        return "baseline" if self.mode == "baseline" else self.backend

    @property
    def block_range(self) -> range:
        """The blocks of a chain, in order (one block otherwise)."""
        return range(self.block, (self.last_block if self.last_block is not None else self.block) + 1)

    def config(self) -> H3Config:
        """The model's config; a synthetic chain or trajectory has as many blocks as it reaches."""
        if self.synthetic is not None:
            c = H3Config.named(self.synthetic)
            return c.replace(num_layers=max(self.block_range.stop, 1)) if self.task != "block" else c
        from h3lab.io.manifest import find_layout  # the folder itself, or a repo's transformer/

        return H3Config.from_json(find_layout(self.checkpoint).folder)  # type: ignore[arg-type]

    def weights(self, device: torch.device | str = "cpu") -> BlockWeights:
        if self.synthetic is not None:
            w = synthetic_block(self.config(), self.block, seed=self.weights_seed)
        else:
            from h3lab.io.checkpoint import load_block

            w = load_block(self.checkpoint, self.block)
        return w.to(device)

    def model_weights(self, device: torch.device | str = "cpu"):
        """A lazy whole-model weight provider (h3lab.model.weights), for chains, trajectories and training;
        synthetic weights drawn by `weights_generator`'s generator."""
        from h3lab.model.weights import CheckpointWeights, SyntheticWeights

        if self.synthetic is not None:  # on a GPU its generator draws 50 real blocks in seconds
            generator = device if self.weights_generator == "device" else "cpu"
            return SyntheticWeights(self.config(), seed=self.weights_seed, device=device, generator=generator)
        return CheckpointWeights(self.checkpoint, device=device)  # type: ignore[arg-type]

    def batch(self, device: torch.device | str = "cpu") -> PackedBatch:
        return packed_batch(self.config(), self.rows, seed=self.seed, padding=self.padding).to(device)

    def model_inputs(self, device: torch.device | str = "cpu") -> ModelInputs:
        """The request of a trajectory or a training run: `model_inputs` from `seed`, rows in `row_order`."""
        from h3lab.batch import derived_seed
        from h3lab.model.packing import model_inputs, shuffle_rows

        inputs = model_inputs(self.config(), seed=self.seed, num_text=self.text_rows)
        if self.row_order == "shuffled":
            inputs = shuffle_rows(inputs, derived_seed(self.seed, "rows"))
        return inputs.to(device)

    def hyper(self) -> AdamWHyper:
        """A training run's optimizer hyperparameters (`ValueError` naming a bad one)."""
        return AdamWHyper(
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
        )

    def check_layout(self, layout: Layout) -> None:
        """Raise if `layout` cannot run this problem's config (heads and SwiGLU columns split over tp)."""
        layout.check(self.config())

    def rank_device(self, local_rank: int) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())

    def one_gpu_per_rank(self, layout: Layout) -> bool:
        """NCCL needs distinct GPUs; with fewer GPUs than local ranks, bytes travel over gloo (CPU)."""
        return torch.cuda.device_count() >= layout.local

    def checkpoint_record(self) -> dict[str, Any]:
        """Where the weights come from: a synthetic config and seed, or a checkpoint folder and whether
        it has a manifest (every load then verifies each file and tensor against it, or raises)."""
        if self.synthetic is not None:
            return {"synthetic": self.synthetic, "weights_seed": self.weights_seed}
        from h3lab.io.manifest import MANIFEST_NAME, find_layout

        folder = find_layout(self.checkpoint).folder
        verified = (folder / MANIFEST_NAME).is_file()
        return {"path": str(folder.resolve()), "manifest_verified": verified}

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON holds it (betas a list), so a summary returned equals the summary read back."""
        return dataclasses.asdict(self) | {"betas": list(self.betas)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Problem:
        return cls(**raw)


def _check_int(name: str, value: object) -> None:
    """A count or an index of the request: an int (not a bool; JSON and papermill give any type)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}; allowed: an int")
