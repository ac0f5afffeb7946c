"""One rank of h3lab.bench.parallelize_step (`--worker`): its sides, each a training step timed on its own
copy of the weights, with its bits and one step's host synchronisations (that module's docstring)."""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from h3lab.bench.host_syncs import host_syncs
from h3lab.bench.step_timing import StepClock, run_side
from h3lab.config import H3Config
from h3lab.io.jsonfile import write_json
from h3lab.metrics import digest
from h3lab.model.packing import request_of_rows
from h3lab.model.weights import SyntheticWeights
from h3lab.parallel.layout import Layout

BITWISE_STEPS = 2  # untimed, then compared
LR, MAX_NORM = 1e-5, 1.0


def worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx = context(spec)
    layout, device = ctx.layout, ctx.device
    sides: dict[str, Any] = {}
    names = ("parallelize_custom",) if layout.world > 1 else tuple(spec["order"].split(","))
    for name in names:
        sides[name] = SIDES[name](ctx)
        _free(device)
    transport = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    out = {"rank": rank, "world": world, "layout": layout.name, "device": str(device), "transport": transport}
    write_json(Path(spec["dir"]) / f"rank{rank}.json", out | {"sides": sides})
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def context(spec: dict[str, str]) -> types.SimpleNamespace:
    """What every side of a rank reads: the spec, the layout, the device (this rank's GPU), the weights
    and the request (made before any timing), the seed."""
    layout = Layout.parse(spec["layout"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    config = H3Config.named(spec["config"]).replace(num_layers=int(spec["layers"]))
    seed = int(spec["seed"])
    weights = SyntheticWeights(config, seed=seed, device=device, generator=device)
    inputs = request_of_rows(config, int(spec["rows"]), seed + 1).to(device)
    return types.SimpleNamespace(spec=spec, layout=layout, device=device, weights=weights, inputs=inputs, seed=seed)


def _model(ctx: types.SimpleNamespace):
    """A parallelized diffusers model of the depth, on its own copy of the weights."""
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3RotaryPosEmbed,
        MiniMaxH3Transformer3DModel,
    )

    import h3lab
    from h3lab.reference.eager_train import depth_state

    config = ctx.weights.config
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config.to_dict())
    model.load_state_dict(depth_state(ctx.weights, range(config.num_layers)), strict=True, assign=True)
    model.rope = MiniMaxH3RotaryPosEmbed(config.rope_freq_dim, config.rope_theta).to(ctx.device)
    return h3lab.parallelize(model, ctx.layout, backend=ctx.spec["backend"])


Mark = Callable[[str], None]  # the clock's mark: the phase that ends now
Step = Callable[[int, Mark], tuple[Tensor, Tensor, dict[str, float]]]  # k, mark -> loss, norm, phases it timed
Weights = Callable[[], dict[str, Tensor]]  # every weight whole, for the digests


def _no_mark(phase: str) -> None:
    return None


def _timed(ctx: types.SimpleNamespace, step: Step, weights: Weights) -> dict:
    """Steps 1-2 untimed and their bits, then `--steps` timed steps, then one more step's host
    synchronisations (module docstring)."""
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else (lambda: None)
    losses, norms = [], []
    for k in range(1, BITWISE_STEPS + 1):
        loss, norm, _ = step(k, _no_mark)
        losses.append(float(loss).hex()), norms.append(float(norm).hex())
    digests = {n: digest(t) for n, t in weights().items()}

    def timed(k: int, clock: StepClock) -> dict[str, Any]:
        barrier()
        clock.start()
        loss, norm, phases = step(BITWISE_STEPS + k, clock.mark)
        total, marked = clock.stop()
        return {
            "step": BITWISE_STEPS + k,
            "seconds": total,
            "phases": marked | phases,
            "loss": float(loss),
            "grad_norm": float(norm),
        }

    steps = int(ctx.spec["steps"])
    out = run_side(timed, 0, steps, ctx.device)
    barrier()
    syncs = host_syncs(lambda: step(BITWISE_STEPS + steps + 1, _no_mark), ctx.device)
    return out | {"losses": losses, "norms": norms, "weights": digests, "host_syncs": syncs}


def flow_step(ctx: types.SimpleNamespace) -> tuple[Step, Weights]:
    """`parallelize_flow`'s step (module docstring), its phases marked as each call returns, and
    model_forward's and model_backward's own clocks (as Trainer's)."""
    import h3lab.optim
    from h3lab.nn import diffusers_kwargs, flow_matching_loss, full_state_dict
    from h3lab.nn.state import state_of
    from h3lab.train.objective import FlowObjective
    from h3lab.train.step import step_seed

    model, objective = _model(ctx), FlowObjective()
    opt = h3lab.optim.AdamW(model.parameters(), lr=LR)
    state = state_of(model)

    def step(k: int, mark: Mark) -> tuple[Tensor, Tensor, dict[str, float]]:
        sample = objective.sample(ctx.inputs, step_seed(ctx.seed, k))
        kwargs = diffusers_kwargs(sample.inputs)
        mark("sample")
        out = model(**kwargs)
        mark("forward")
        loss = flow_matching_loss(objective, sample, out.sample[0], out.audio_sample[0])
        mark("loss")
        norm = _backward_and_update(loss, model, opt, mark)
        return loss.detach(), norm, {f"model_{p.removesuffix('_s')}": v for p, v in state.timings.items()}

    return step, lambda: full_state_dict(model)


def _backward_and_update(loss: Tensor, model: torch.nn.Module, opt: torch.optim.Optimizer, mark: Mark) -> Tensor:
    """What a user's loop does after its loss: backward, h3lab's clip, the optimizer's step; each
    phase marked as it returns. The norm before clipping."""
    import h3lab.optim

    loss.backward()
    mark("backward")
    norm = h3lab.optim.clip_grad_norm_(model, MAX_NORM)
    mark("clip")
    opt.step()
    opt.zero_grad()
    mark("update")
    return norm


def custom_step(ctx: types.SimpleNamespace) -> tuple[Step, Weights]:
    """`parallelize_custom`'s step (module docstring), its phases marked as each call returns."""
    import h3lab.optim
    from h3lab.nn import diffusers_kwargs, full_state_dict

    model = _model(ctx)
    opt = h3lab.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(ctx.seed + 2)
    i = ctx.inputs
    targets = [torch.randn(t.shape, generator=g).to(ctx.device) for t in (i.video_rows, i.audio_rows)]
    advantage = torch.randn(i.video_rows.shape[0], generator=g).to(ctx.device)
    kwargs = diffusers_kwargs(i)

    def step(k: int, mark: Mark) -> tuple[Tensor, Tensor, dict[str, float]]:
        out = model(**kwargs)
        mark("forward")
        mse = ((out.sample[0] - targets[0]) ** 2).mean(-1)
        cos = F.cosine_similarity(out.audio_sample[0], targets[1], dim=-1)
        loss = (advantage * mse.clamp(max=4.0)).mean() + 0.5 * (1 - cos).clamp(min=0.05).mean()
        mark("loss")
        return loss.detach(), _backward_and_update(loss, model, opt, mark), {}

    return step, lambda: full_state_dict(model)


def trainer_step(ctx: types.SimpleNamespace) -> tuple[Step, Weights]:
    """`trainer`'s step; its phases are its own clocks' (`TrainStep.timings`: model_forward's,
    model_backward's, the clip's, the update's). The clip's ends when the clip is queued and the
    update's waits for both (AdamW.step reads the norm's finiteness after the updates), where the
    flow's clip waits for its norm (clip_grad_norm_ refuses when called): compare clip + update."""
    from h3lab.backend import get_backend
    from h3lab.train.adamw import AdamWHyper
    from h3lab.train.step import Trainer

    be = get_backend(ctx.spec["backend"], ctx.device)
    blocks = range(ctx.weights.config.num_layers)
    hyper = AdamWHyper(lr=LR, max_grad_norm=MAX_NORM)
    t = Trainer(ctx.weights, ctx.inputs, blocks=blocks, hyper=hyper, seed=ctx.seed, backend=be)

    def step(k: int, mark: Mark) -> tuple[Tensor, Tensor, dict[str, float]]:
        s = t.step(k)
        names = {"forward_s": "model_forward", "backward_s": "model_backward", "clip_s": "clip", "update_s": "update"}
        return s.loss, s.grad_norm, {names[p]: v for p, v in s.timings.items()}

    return step, lambda: dict(t.weights.tensors)


def parallelize_flow(ctx: types.SimpleNamespace) -> dict[str, Any]:
    return _timed(ctx, *flow_step(ctx))


def parallelize_custom(ctx: types.SimpleNamespace) -> dict[str, Any]:
    return _timed(ctx, *custom_step(ctx))


def trainer(ctx: types.SimpleNamespace) -> dict[str, Any]:
    return _timed(ctx, *trainer_step(ctx))


def eager(ctx: types.SimpleNamespace) -> dict[str, Any]:
    """h3lab.bench.train_step's eager side (its own warm-up of 2 steps, then `--steps` timed)."""
    from h3lab.bench.train_step import eager_side
    from h3lab.train.adamw import AdamWHyper

    blocks = tuple(range(ctx.weights.config.num_layers))
    a = types.SimpleNamespace(
        warmup=BITWISE_STEPS,
        steps=int(ctx.spec["steps"]),
        device=ctx.device,
        blocks=blocks,
        hyper=AdamWHyper(lr=LR, max_grad_norm=MAX_NORM),
        seed=ctx.seed,
    )
    return eager_side(a, ctx.weights, ctx.inputs)


SIDES = {
    "parallelize_flow": parallelize_flow,
    "trainer": trainer,
    "eager": eager,
    "parallelize_custom": parallelize_custom,
}


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
