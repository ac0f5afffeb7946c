"""`parallelize(model, layout)`: diffusers' `MiniMaxH3Transformer3DModel` made deterministic in place.

    model = MiniMaxH3Transformer3DModel.from_pretrained(...).to(device)
    model = h3lab.parallelize(model, h3lab.current_layout())      # or "tp2", "tp4xcp2+sp", ...
    out = model(**diffusers_kwargs)                               # diffusers' signature and output
    my_loss(out.sample, out.audio_sample).backward()              # every .grad: h3lab's contract

In diffusers' spirit (a plan applied to the model once; the model stays an instance of its class
and keeps its calls),
with h3lab's contract instead of a library's reductions: the output and every gradient have the
bytes of the single process under every layout; tensor parallelism as well as context and sequence
parallelism; a row count that does not divide the layout's row shards is padded inside (the padding
rows reach no result and leave the output), where diffusers' `_cp_plan` needs the sequence divisible
by its context-parallel degree. What changes on the model:
- its class becomes a subclass of its own whose `forward` is h3lab's (h3lab.nn.function); the
  signature and the output type are diffusers'; `logical_keys=` may name the rows (h3lab.nn.inputs);
- each block's unit-sharded weights are replaced by this rank's shards (h3lab.nn.state): memory per
  rank drops with TP; `h3lab.full_state_dict(model)` gives the whole tensors back;
- cuBLAS' reduced-precision reductions are switched off for the process, and every forward and
  backward refuses TF32 or reduced-precision reductions switched on again (h3lab.contract).

Inside `torchrun` the world size must be the layout's ranks; h3lab creates the process groups from
the layout (`Layout.groups()`), and initialises the default one if the program did not (NCCL when
every local rank has a GPU of its own, else gloo). `mesh=` may hand a `DeviceMesh` whose dims are
named `tp` (and `cp`): it must lay out the layout's groups; h3lab's collectives use groups of their own.
Everything outside the block stack runs in full on every rank, as h3lab's training step does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from h3lab.backend import CONTRACT_BACKENDS, Backend, get_backend
from h3lab.comm import BlockComm, LocalComm
from h3lab.config import FP32_MODULE_PREFIXES, H3Config, model_param_shapes
from h3lab.contract import check_strict_flags, reduced_precision_off
from h3lab.nn import recording
from h3lab.nn.function import velocity
from h3lab.nn.inputs import model_inputs_of
from h3lab.nn.state import ParallelState, register, state_of
from h3lab.parallel.distcomm import build_comm
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.units import unit_shards
from h3lab.weights import BlockWeights

ALLOWED_DEVICES = ("cpu", "cuda")


def parallelize(
    model: nn.Module,
    layout: str | Layout,
    *,
    backend: str | Backend | None = None,
    mesh: Any = None,
) -> nn.Module:
    """Make `model` deterministic in place under `layout` and return it (module docstring).

    Args:
        model: diffusers' `MiniMaxH3Transformer3DModel` (any config h3lab runs, any weights; the
            checkpoint's mixed precision or float32 throughout), its parameters on one device: the
            CPU, or this rank's GPU (which becomes the current CUDA device).
        layout: a layout name (`h3lab.parallel.layout` grammar) or a `Layout`.
        backend: the kernels, "torch" or "triton" (a name or a backend object); default: triton on
            CUDA, torch on the CPU.
        mesh: optionally a `torch.distributed.device_mesh.DeviceMesh` with dims named "tp" and "cp"
            that must lay out the layout's TP and CP groups.

    Raises:
        ValueError: one line naming the value and what is allowed, for a model that is not a
            `MiniMaxH3Transformer3DModel`, one parallelized already, PEFT/LoRA adapters, diffusers'
            own parallelism, parameters of other names, shapes, dtypes or devices or not finite, a
            world size or a mesh that does not match the layout, TF32 on, a backend outside the contract.
    """
    config = _check_model(model)
    layout = Layout.parse(layout) if isinstance(layout, str) else layout
    if not isinstance(layout, Layout):
        raise ValueError(f"layout {layout!r}; allowed: a layout name such as 'tp2', or an h3lab Layout")
    layout.check(config)
    if mesh is not None:
        check_mesh(layout, mesh)
    device = _check_params(model)
    check_strict_flags(reductions=False)  # TF32 on is the caller's explicit choice: refused, never overridden
    be = _backend(backend, device)
    _check_world(layout)
    # every refusal is above: from here on the process and the model change
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and Triton launch on the current device
    rank = _join_world(layout, device)
    comm: BlockComm = LocalComm() if layout.world == 1 else _comm(layout, rank, device)
    _shard_blocks(model, config, comm.units)
    reduced_precision_off()
    rows = None if layout.row_shards == 1 else (lambda b: SeqShard(layout, b.num_rows).coshard(b, rank))
    names = tuple(n for n, _ in model.named_parameters())
    state = ParallelState(layout, rank, config, comm, be, device, rows, names)
    model.__class__ = _parallel_class(type(model))
    register(model, state)
    return model


def _check_model(model: object) -> H3Config:
    """The model's config, if it is a `MiniMaxH3Transformer3DModel` h3lab can run as it is."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    if not isinstance(model, MiniMaxH3Transformer3DModel):
        raise ValueError(f"model is a {type(model).__name__}; allowed: diffusers' MiniMaxH3Transformer3DModel")
    if state_of(model) is not None:
        raise ValueError(
            f"model is parallelized already (layout {state_of(model).layout.name}); allowed: one h3lab.parallelize "
            "per model"
        )
    names = [n for n, _ in model.named_modules()]
    if getattr(model, "_hf_peft_config_loaded", False) or any("lora_" in n or n.endswith("base_layer") for n in names):
        raise ValueError(
            "model carries PEFT/LoRA adapters; not supported yet; allowed: a model without adapters (merge them "
            "into the weights first, e.g. diffusers' fuse_lora, then unload them)"
        )
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError("model has diffusers' own parallelism enabled; allowed: a model without enable_parallelism")
    config = H3Config.from_dict({k: v for k, v in dict(model.config).items() if not k.startswith("_")})
    shapes = model_param_shapes(config)
    held = {n: tuple(p.shape) for n, p in model.named_parameters()}
    odd = sorted(held.keys() ^ shapes.keys()) + [n for n in held if n in shapes and shapes[n] != held[n]]
    if odd:
        raise ValueError(
            f"parameters {odd[:3]} are not MiniMaxH3Transformer3DModel's of this config; allowed: its parameters"
        )
    return config


def _check_params(model: nn.Module) -> torch.device:
    """The one device every parameter and buffer is on, if the parameters' dtypes and values can run."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    devices = sorted({str(t.device) for _, t in tensors})
    if len(devices) != 1:
        raise ValueError(f"parameters and buffers on {devices}; allowed: one device")
    device = tensors[0][1].device
    if device.type not in ALLOWED_DEVICES:
        raise ValueError(f"parameters on {device}; allowed: {list(ALLOWED_DEVICES)}")
    for name, p in model.named_parameters():
        allowed = (torch.float32,) if name.startswith(FP32_MODULE_PREFIXES) else (torch.bfloat16, torch.float32)
        if p.dtype not in allowed:
            raise ValueError(f"{name}: {p.dtype}; allowed: {[str(d) for d in allowed]}")
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"{name}: holds inf or NaN; allowed: finite weights")
    return device


def check_mesh(layout: Layout, mesh: Any) -> None:
    """Refuse a device mesh that does not lay out `layout`: dims named "tp" (and "cp" for cp > 1) whose
    slices are the layout's TP and CP groups."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    allowed = "a DeviceMesh with dims named 'tp' and 'cp' laying out the layout's groups"
    if not set(names) <= {"tp", "cp"} or "tp" not in names or len(set(names)) != len(names):
        raise ValueError(f"mesh dims {names}; allowed: {allowed}")
    ranks = torch.as_tensor(mesh.mesh).to(torch.int64)
    if "cp" not in names:
        ranks, names = ranks[None], ("cp", *names)
    grid = ranks.permute(names.index("cp"), names.index("tp"))  # [cp, tp]
    groups = layout.groups()
    tp = tuple(tuple(row.tolist()) for row in grid)
    cp = tuple(tuple(col.tolist()) for col in grid.t())
    if tp != groups.tp or cp != groups.cp:
        raise ValueError(
            f"mesh (cp={grid.shape[0]}, tp={grid.shape[1]}) has TP groups {list(tp)} but layout {layout.name} "
            f"has {list(groups.tp)}; allowed: {allowed}"
        )


def _world() -> tuple[bool, int]:
    """(torch.distributed is initialised, the world size: its own, or torchrun's WORLD_SIZE, else 1)."""
    initialised = dist.is_available() and dist.is_initialized()
    return initialised, dist.get_world_size() if initialised else int(os.environ.get("WORLD_SIZE", "1"))


def _check_world(layout: Layout) -> None:
    world = _world()[1]
    if world != layout.world:
        raise ValueError(
            f"world size {world} for layout {layout.name}; allowed: {layout.world} ranks "
            f"(torchrun --nproc-per-node {layout.world}, or a layout of {world} ranks)"
        )


def _join_world(layout: Layout, device: torch.device) -> int:
    """This process's rank in the world of `layout.world` ranks (initialising the default group)."""
    initialised, world = _world()
    if world == 1:
        return 0
    if not initialised:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        own_gpu = device.type == "cuda" and torch.cuda.device_count() >= local
        dist.init_process_group("nccl" if own_gpu else "gloo", device_id=device if own_gpu else None)
    return dist.get_rank()


def _backend(backend: str | Backend | None, device: torch.device) -> Backend:
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    be = get_backend(backend, device) if isinstance(backend, str) else backend
    if be.name not in CONTRACT_BACKENDS:
        raise ValueError(f"backend {be.name!r}; allowed: {list(CONTRACT_BACKENDS)} (the contract's kernels)")
    return be


def _comm(layout: Layout, rank: int, device: torch.device) -> BlockComm:
    session = recording.session()
    on_call = session.tick if session is not None else None  # a compare rank's status names its collectives
    comm = build_comm(
        layout, rank, mode="deterministic", algorithm="auto", device=device, act_dtype=torch.bfloat16, on_call=on_call
    )
    assert comm is not None  # the world is the layout's
    return comm


def _shard_blocks(model: nn.Module, config: H3Config, units: range) -> None:
    """Replace every block's unit-sharded weights by this rank's shards (copies: the whole tensors go)."""
    if units == range(8):
        return  # tp1: the shards are the tensors themselves
    for i, block in enumerate(model.transformer_blocks):
        params = dict(block.named_parameters())
        shards = unit_shards(BlockWeights(config, {k: p.detach() for k, p in params.items()}, f"block{i}"), units)
        for name, shard in shards.items():
            owner, attr = block.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            setattr(owner, attr, nn.Parameter(shard.clone(), requires_grad=params[name].requires_grad))


_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    """`cls` with h3lab's forward (one subclass per class, so isinstance and the class's methods stay)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"H3lab{cls.__name__}", (cls,), {"forward": _forward, "__module__": __name__})
    return _CLASSES[cls]


def _forward(
    self: nn.Module,
    hidden_states: Tensor,
    audio_hidden_states: Tensor,
    encoder_hidden_states: Tensor,
    timestep: Tensor,
    timestep_indices: Tensor,
    token_tags: Tensor,
    position_ids: Tensor,
    video_indices: Tensor,
    audio_indices: Tensor,
    text_indices: Tensor,
    attention_kwargs: dict[str, Any] | None = None,
    return_dict: bool = True,
    *,
    logical_keys: Tensor | None = None,
) -> Any:
    """diffusers' `MiniMaxH3Transformer3DModel.forward`, computed by h3lab (h3lab.nn.function)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerOutput

    state = state_of(self)
    if attention_kwargs:
        raise ValueError(f"attention_kwargs={attention_kwargs!r}; allowed: None (LoRA scales: adapters not supported)")
    if state.clip is not None and torch.is_grad_enabled():
        raise ValueError(
            "h3lab.optim.clip_grad_norm_'s coefficient was never applied; allowed: h3lab.optim.AdamW.step() (or "
            "zero_grad()) after clip_grad_norm_, before the next forward"
        )
    kwargs = {
        "hidden_states": hidden_states,
        "audio_hidden_states": audio_hidden_states,
        "encoder_hidden_states": encoder_hidden_states,
        "timestep": timestep,
        "timestep_indices": timestep_indices,
        "token_tags": token_tags,
        "position_ids": position_ids,
        "video_indices": video_indices,
        "audio_indices": audio_indices,
        "text_indices": text_indices,
    }
    inputs = model_inputs_of(kwargs, state.device, logical_keys)
    video, audio = velocity(state, state.params(self), inputs)
    if not return_dict:
        return video[None], audio[None]
    return MiniMaxH3TransformerOutput(sample=video[None], audio_sample=audio[None])


__all__ = ["check_mesh", "parallelize"]
