"""Your own training on diffusers' MiniMax-H3 model, with the same bytes under every layout.

    python examples/my_train.py                                   # one process: tp1
    h3lab compare --layout tp2 tp4xcp2+sp tp8:2x4 -- python examples/my_train.py --steps 2

A tiny model (random weights in the checkpoint's mixed precision), one request of 91 packed rows in
an order of its own, a loss that is not h3lab's (an advantage-weighted, clamped MSE of the video head
plus a cosine term on the audio head), AdamW with a clip. Each step records its loss, its gradient
norm, every gradient and every weight for `h3lab compare` (`h3lab.record` does nothing outside it);
the end records every weight whole. notebooks/your_code.py runs it interactively.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

import h3lab
import h3lab.optim
from h3lab.config import H3Config, param_dtype
from h3lab.model import model_inputs, shuffle_rows
from h3lab.nn import diffusers_kwargs

CONFIG = H3Config.tiny().replace(num_layers=2)  # 8 heads: tp8 holds one each


def tiny_model(seed: int = 0) -> MiniMaxH3Transformer3DModel:
    """diffusers' model with its own initialisation, in the real checkpoint's dtypes."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**CONFIG.to_dict())
    for name, p in model.named_parameters():
        p.data = p.data.to(param_dtype(name))  # float32 embedders, time MLP and heads; bf16 elsewhere
    return model


def my_loss(video: torch.Tensor, audio: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    mse = ((video - batch["target_video"]) ** 2).mean(-1)
    cos = F.cosine_similarity(audio, batch["target_audio"], dim=-1)
    return (batch["advantage"] * mse.clamp(max=4.0)).mean() + 0.5 * (1 - cos).clamp(min=0.05).mean()


def request(seed: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """diffusers' forward arguments for one request (its rows shuffled), and the loss's targets."""
    inputs = shuffle_rows(model_inputs(CONFIG, seed=seed, num_text=7), seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    batch = {
        "target_video": torch.randn(inputs.video_rows.shape, generator=g),
        "target_audio": torch.randn(inputs.audio_rows.shape, generator=g),
        "advantage": torch.randn(inputs.video_rows.shape[0], generator=g),
    }
    return diffusers_kwargs(inputs), batch


def train(model: MiniMaxH3Transformer3DModel, steps: int, max_norm: float = 0.1) -> Iterator[tuple[int, float, float]]:
    """`steps` steps of AdamW on `my_loss`, recording as they go; yields (step, loss, gradient norm)."""
    optimizer = h3lab.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    kwargs, batch = request()
    for k in range(1, steps + 1):
        out = model(**kwargs)
        loss = my_loss(out.sample[0], out.audio_sample[0], batch)
        loss.backward()
        norm = h3lab.optim.clip_grad_norm_(model, max_norm)
        h3lab.record(f"step{k}.loss", loss.detach())
        h3lab.record(f"step{k}.grad_norm", norm)
        for name, p in model.named_parameters():
            h3lab.record(f"step{k}.dw.{name}", p.grad)  # a shard under TP: h3lab compare joins them
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.named_parameters():
            h3lab.record(f"step{k}.w.{name}", p)
        yield k, float(loss.detach()), float(norm)
    for name, t in h3lab.full_state_dict(model).items():
        h3lab.record(f"final.{name}", t)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args(argv)
    layout = h3lab.current_layout()  # what h3lab compare runs; tp1 in a plain process
    model = h3lab.parallelize(tiny_model(), layout)
    for k, loss, norm in train(model, a.steps):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            continue
        print(f"{layout.name} step {k}: loss {loss:.6f}, gradient norm {norm:.6f}", flush=True)


if __name__ == "__main__":
    main()
