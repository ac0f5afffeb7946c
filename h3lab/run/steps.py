"""A training run's tensors by step and kind: the per-step verdicts and values of `summary.json`.

Names (h3lab.train.step): `step{k}.<rest>`, and the kind of <rest> (a `block{i}.` before it aside):
  loss       `loss`, `loss.video`, `loss.audio`
  clip       `grad_norm`, `clip_coef`
  gradients  `dw.<parameter or unit gradient>`
  weights    `w.<parameter or unit gradient>`, after the step's update
"""

from __future__ import annotations

from torch import Tensor

from h3lab.tensorname import TensorName

KINDS = ("loss", "clip", "gradients", "weights")


def step_kind(name: str) -> tuple[int, str] | None:
    """(step, kind) of a training run's tensor name; None for a name of no training step."""
    n = TensorName.parse(name)
    if n.step is None:
        return None
    rest = str(n.replace(step=None, block=None))
    if rest == "loss" or rest.startswith("loss."):
        kind = "loss"
    elif rest in ("grad_norm", "clip_coef"):
        kind = "clip"
    elif rest.startswith("dw."):
        kind = "gradients"
    elif rest.startswith("w."):
        kind = "weights"
    else:
        return None
    return n.step, kind


def step_verdicts(verdicts: dict[str, dict]) -> dict[str, dict]:
    """Tensor verdicts (`bitwise_equal` each) grouped per step and kind, steps ascending (keys "1", "2", ...):
    `{"bitwise_equal": every tensor of the step, kind: {"equal": n, "total": m, "bitwise_equal": n == m}}`."""
    counts: dict[int, dict[str, list[int]]] = {}
    for name, v in verdicts.items():
        sk = step_kind(name)
        if sk is not None:
            c = counts.setdefault(sk[0], {}).setdefault(sk[1], [0, 0])
            c[0] += bool(v["bitwise_equal"])
            c[1] += 1
    out = {}
    for k in sorted(counts):
        got = counts[k]
        kinds = {kind: {"equal": got[kind][0], "total": got[kind][1]} for kind in KINDS if kind in got}
        kinds = {kind: v | {"bitwise_equal": v["equal"] == v["total"]} for kind, v in kinds.items()}
        out[str(k)] = {"bitwise_equal": all(v["bitwise_equal"] for v in kinds.values())} | kinds
    return out


def step_values(tensors: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    """The scalars of every step (loss, loss.video, loss.audio, grad_norm, clip_coef) as floats, steps ascending."""
    out: dict[int, dict[str, float]] = {}
    for name, t in tensors.items():
        sk = step_kind(name)
        if sk is not None and sk[1] in ("loss", "clip") and t.dim() == 0:
            out.setdefault(sk[0], {})[str(TensorName.parse(name).replace(step=None))] = float(t)
    return {str(k): out[k] for k in sorted(out)}
