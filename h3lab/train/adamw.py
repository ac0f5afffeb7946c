"""AdamW on FP32 master weights, one state per piece a rank holds (h3lab.train.pieces).

The algorithm is torch.optim.AdamW's (decoupled weight decay, bias corrections; no amsgrad, no
maximize), every piece updated by the backend's `adamw_updates` (reference: h3lab.ops.adamw, which
states the operations and why each is a separate IEEE FP32 op; the Triton kernel has its bits), the
gradient scaled by the clip coefficient (h3lab.train.clip) and the weight written back with one
rounding. The scalars are computed in float64 and rounded once to FP32, into one FP32 tensor on the
pieces' device; beta^t is a running float64 product (IEEE multiplies: no C library pow, whose last
bit may differ between machines).

A step updates every piece or none: the clip's global norm needs every gradient, so one step count
serves all pieces. A NaN or Inf in any gradient (or squares that overflow FP32) makes the norm
non-finite; the step then raises `NonFiniteGradError` having changed nothing (catching it skips the
step): its updates were queued behind the norm and run only where it is finite (the Triton kernels
read that on the device, the torch reference on the host), and the host learns it with the
weights' flags in one read after the updates. The norm has the same bits on every rank, so every
rank of a layout raises together.
An update that leaves a NaN or Inf in a weight (finite gradients, an overflowing learning rate)
raises `NonFiniteWeightError` naming the step and the pieces (the update itself says which: no
second pass over the weights); the weights then hold those values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.comm import BlockComm
from h3lab.config import H3Config
from h3lab.host import to_device
from h3lab.ops.adamw import ADAMW_SCALARS
from h3lab.train.clip import GradNorm, clip_coefficient, global_grad_norm, to_f32
from h3lab.train.pieces import Piece, piece_label, rank_pieces

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True, kw_only=True)
class AdamWHyper:
    """AdamW's hyperparameters (torch.optim.AdamW's defaults) and the clip's max_grad_norm (inf: no clip)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if not (_number(self.lr) and 0 <= self.lr < math.inf):
            raise ValueError(f"lr {self.lr!r} not allowed; allowed: a finite number >= 0")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"betas {self.betas!r} not allowed; allowed: two numbers in [0, 1)")
        object.__setattr__(self, "betas", tuple(self.betas))
        for k, beta in enumerate(self.betas):
            if not (_number(beta) and 0 <= beta < 1):
                raise ValueError(f"betas[{k}] {beta!r} not allowed; allowed: a number in [0, 1)")
        if not (_number(self.eps) and 0 < self.eps < math.inf):
            raise ValueError(f"eps {self.eps!r} not allowed; allowed: a finite number > 0")
        if not (_number(self.weight_decay) and 0 <= self.weight_decay < math.inf):
            raise ValueError(f"weight_decay {self.weight_decay!r} not allowed; allowed: a finite number >= 0")
        if not (_number(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm {self.max_grad_norm!r} not allowed; allowed: a number in (0, inf]")


def step_scalars(hyper: AdamWHyper, beta1_pow: float, beta2_pow: float, device: torch.device) -> Tensor:
    """FP32 [8] on `device`: the scalars (h3lab.ops.adamw.ADAMW_SCALARS order) of the step at which
    beta1^t = beta1_pow and beta2^t = beta2_pow, each a float64 expression rounded once to FP32."""
    b1, b2 = hyper.betas
    values = {
        "decay": 1.0 - hyper.lr * hyper.weight_decay,
        "beta1": b1,
        "one_minus_beta1": 1.0 - b1,
        "beta2": b2,
        "one_minus_beta2": 1.0 - b2,
        "bias2_sqrt": math.sqrt(1.0 - beta2_pow),
        "step_size": hyper.lr / (1.0 - beta1_pow),
        "eps": hyper.eps,
    }
    assert tuple(values) == ADAMW_SCALARS, "h3lab.ops.adamw changed its scalars"
    return to_device([to_f32(v) for v in values.values()], torch.float32, device)  # no host sync


def next_beta_pows(hyper: AdamWHyper, pows: tuple[float, float]) -> tuple[float, float]:
    """(beta1^t, beta2^t) of the next step from this step's: one float64 multiply each."""
    b1, b2 = hyper.betas
    return pows[0] * b1, pows[1] * b2


def clipped_norm(
    grads: Mapping[Piece, Tensor],
    *,
    comm: BlockComm,
    config: H3Config,
    backend: Backend,
    max_norm: float,
    at: str,
) -> tuple[GradNorm, Tensor]:
    """The global norm of every rank's `grads` (h3lab.train.clip) and the clip coefficient; `at` names
    the step in the refusal ("step 3").

    Raises:
        NonFiniteGradError: the norm is NaN or Inf (a host sync: the norm is done when it returns).
    """
    gn = global_grad_norm(grads, comm, config, backend)
    if not bool(torch.isfinite(gn.total)):
        raise nonfinite_norm(gn, at)
    return gn, clip_coefficient(gn.norm, max_norm)


def nonfinite_norm(gn: GradNorm, at: str) -> NonFiniteGradError:
    """The refusal of a step whose global norm is NaN or Inf, naming the pieces (host syncs)."""
    bad = [piece_label(p, "dw") for p in gn.nonfinite_pieces()]
    where = f"non-finite sums of squares in {bad[:4]}{' ...' if len(bad) > 4 else ''}" if bad else "overflow"
    return NonFiniteGradError(
        f"{at}: gradient norm {float(gn.norm)} ({where}); step refused, nothing "
        "changed; allowed: finite gradients whose sum of squares fits FP32"
    )


@dataclass(frozen=True, eq=False)
class PieceState:
    """A piece's FP32 state: the master weight (initialised exactly from the weight) and the moments."""

    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor

    @classmethod
    def init(cls, weight: Tensor) -> PieceState:
        master = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        master.copy_(weight)  # bf16 -> fp32 widens exactly; fp32 is copied
        return cls(master, torch.zeros_like(master), torch.zeros_like(master))


@dataclass(frozen=True)
class StepRecord:
    step: int  # steps taken, this one included
    grad_norm: Tensor  # 0-d float32, before clipping; identical on every rank
    clip_coef: Tensor  # 0-d float32
    # clip_s: checks, the global norm (its gather included) and the coefficient, queued; update_s:
    # every piece's update and write-back queued, then the one read of the norm's and the weights'
    # finiteness, which waits for all of it. Wall clock of this rank.
    timings: dict[str, float] = field(default_factory=dict)


class NonFiniteGradError(ValueError):
    """The gradients' global norm is NaN or Inf: the step was refused and nothing changed."""


class NonFiniteWeightError(ValueError):
    """The update left a NaN or Inf in a weight: the step changed the weights, the training cannot go on."""


class AdamW:
    """AdamW with FP32 masters for the pieces one rank holds; the single process is the same code with
    all 8 units and LocalComm.

    `weights` are the rank's weight tensors by piece (`block_weight_pieces`, `non_block_pieces`): views
    the step writes the rounded masters into, in place. After construction the masters are the truth:
    a weight changed from outside is overwritten at the next step. `state[piece]` is the piece's
    `PieceState`; every rank of a layout must call `step` together (it gathers the clip's sums).
    """

    def __init__(
        self,
        weights: Mapping[Piece, Tensor],
        *,
        config: H3Config,
        comm: BlockComm,
        hyper: AdamWHyper,
        backend: Backend,
    ) -> None:
        if not weights:
            raise ValueError("AdamW: no weights; allowed: a rank's pieces (h3lab.train.pieces)")
        self.order = rank_pieces(config, weights, comm.units)
        self.device = next(iter(weights.values())).device
        for p, w in weights.items():
            if w.dtype not in _FLOAT_DTYPES or w.device != self.device:
                raise ValueError(
                    f"weight {piece_label(p)}: {w.dtype} on {w.device}; allowed: {list(_FLOAT_DTYPES)} on {self.device}"
                )
        self.config, self.comm, self.hyper = config, comm, hyper
        self.be = backend  # the sums of squares and the updates
        self.weights = {p: weights[p] for p in self.order}
        self.state = {p: PieceState.init(w) for p, w in self.weights.items()}
        self.step_count = 0
        self._beta_pows = (1.0, 1.0)  # beta1^t, beta2^t after step_count steps

    def step(self, grads: Mapping[Piece, Tensor], mark: Callable[[str], None] | None = None) -> StepRecord:
        """Clip by the global norm, update every piece, write the weights (module docstring); `mark(phase)`
        is called as "clip" and "update" end (a profiler's or a timer's hook).

        The updates are queued behind the norm without waiting for it: they run only where it is finite
        (the Triton kernels read that on the device, so on the triton backend the GPU does not drain
        between the clip and the update; the torch reference reads it on the host), and one host read
        after them says whether they ran and which weights they left NaN or Inf. So `mark("clip")` is
        called also for a step that is then refused (no "update" follows).

        Raises:
            ValueError: gradients that do not match the weights' pieces, shapes, device or float dtypes.
            NonFiniteGradError: the global norm is NaN or Inf (nothing was changed).
        """
        start = time.perf_counter()
        self._check(grads)
        gn = global_grad_norm(grads, self.comm, self.config, self.be)
        finite = torch.isfinite(gn.total)
        coef = clip_coefficient(gn.norm, self.hyper.max_grad_norm)
        clipped = time.perf_counter()
        if mark is not None:
            mark("clip")
        pows = next_beta_pows(self.hyper, self._beta_pows)
        s = step_scalars(self.hyper, *pows, self.device)
        pieces = [(st.master, st.exp_avg, st.exp_avg_sq, grads[p], self.weights[p]) for p, st in self.state.items()]
        nonfinite = self.be.adamw_updates(pieces, coef, s, go=finite)
        ran, *flags = torch.cat([finite.reshape(1), nonfinite]).tolist()  # the step's one host read
        if not ran:
            raise nonfinite_norm(gn, f"step {self.step_count + 1}")
        self._check_finite_weights(flags)
        timings = {"clip_s": clipped - start, "update_s": time.perf_counter() - clipped}
        if mark is not None:
            mark("update")
        self.step_count, self._beta_pows = self.step_count + 1, pows
        return StepRecord(step=self.step_count, grad_norm=gn.norm, clip_coef=coef, timings=timings)

    def largest_weights(self) -> dict[Piece, float]:
        """max |w| of every piece this rank holds (NaN where a piece holds one), one host sync. The
        maximum is exact in any order: torch's multi-tensor norm serves, one pass over the weights."""
        maxima = torch._foreach_norm(list(self.weights.values()), math.inf, dtype=torch.float32)
        return dict(zip(self.weights, torch.stack(maxima).tolist(), strict=True))

    def _check_finite_weights(self, nonfinite: list[bool]) -> None:
        """Raise NonFiniteWeightError naming the pieces the update left NaN or Inf in (`nonfinite`, one
        bool per piece in the state's order, as the update said)."""
        bad = [piece_label(p, "w") for p, b in zip(self.state, nonfinite, strict=True) if b]
        if bad:
            shown = f"{bad[:4]}{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}"
            raise NonFiniteWeightError(
                f"step {self.step_count + 1}: the update left NaN or Inf in {shown} (lr {self.hyper.lr:g}); the "
                "weights hold them now; allowed: an update that keeps every weight finite (a smaller lr)"
            )

    def named_weights(self, kind: str = "w") -> dict[str, Tensor]:
        """The rank's weights by runner tensor name (`block{i}.w.<grad>@u{u}`, `block{i}.w.<param>`, `w.<param>`)."""
        return {piece_label(p, kind): w for p, w in self.weights.items()}

    def _check(self, grads: Mapping[Piece, Tensor]) -> None:
        missing = [piece_label(p) for p in self.order if p not in grads]
        extra = [piece_label(p) for p in grads if p not in self.weights]
        if missing or extra:
            raise ValueError(
                f"gradients: missing {missing[:4]}, unexpected {extra[:4]}; allowed: exactly the weights' pieces"
            )
        for p, w in self.weights.items():
            g = grads[p]
            if g.shape != w.shape or g.dtype not in _FLOAT_DTYPES or g.device != self.device:
                raise ValueError(
                    f"gradient {piece_label(p)}: {list(g.shape)} {g.dtype} on {g.device}; "
                    f"allowed: {list(w.shape)}, one of {list(_FLOAT_DTYPES)}, on {self.device}"
                )
