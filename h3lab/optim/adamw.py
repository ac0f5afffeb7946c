"""`AdamW`: a `torch.optim.Optimizer` with the bits of h3lab's training step's update.

The arithmetic is h3lab.train.adamw's: FP32 master weights and moments per parameter a rank holds
(for a unit-sharded block weight, the shard of its units), the backend's `adamw_updates` (separate
IEEE FP32 ops, elementwise, so a parameter updated whole gives the bytes of its pieces updated one
by one), the step's scalars in float64 rounded once to FP32 (`step_scalars`) from running float64
products beta^t (`next_beta_pows`), each weight written back with one rounding, and the clip
coefficient of `h3lab.optim.clip_grad_norm_` applied to the gradient inside the update (1 without a
clip). torch.optim.AdamW's algorithm and defaults (decoupled weight decay, bias corrections; no
amsgrad, no maximize).

As a torch optimizer: param groups with their own lr, betas, eps and weight_decay (a scheduler may
change them between steps), `zero_grad`, `state_dict` / `load_state_dict` (the FP32 state round trips
byte for byte: torch's own `load_state_dict` would cast it to each parameter's dtype), a parameter
without `.grad` skipped. Its state is created at a parameter's first step, from the weight as it is
then; after that the master is the truth (a weight changed from outside is overwritten). Every
parameter must belong to one parallelized model, and the optimizer must be made after
`h3lab.parallelize` (which replaces the sharded weights by new parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from h3lab.nn.state import ParallelState, parallelized
from h3lab.train.adamw import AdamWHyper, next_beta_pows, step_scalars

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)


class AdamW(torch.optim.Optimizer):
    """AdamW over a parallelized model's parameters (module docstring)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        """Raises ValueError for a bad hyperparameter (h3lab.train.adamw.AdamWHyper's refusals), or a
        parameter of no parallelized model, of another model than the others, or not bf16 or fp32."""
        _hyper({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._owner: ParallelState | None = None
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _hyper(group)
        owners = {id(p): s for m, s in parallelized() for p in m.parameters()}
        for k, p in enumerate(group["params"]):
            owner = owners.get(id(p))
            if owner is None:
                raise ValueError(
                    f"parameter {k} of param group {len(self.param_groups) - 1} belongs to no parallelized model; "
                    "allowed: parameters of a model h3lab.parallelize returned (make the optimizer after it)"
                )
            if self._owner is not None and owner is not self._owner:
                raise ValueError("parameters of two parallelized models; allowed: one model's parameters")
            if p.dtype not in _FLOAT_DTYPES:
                raise ValueError(f"parameter {k}: {p.dtype}; allowed: {[str(d) for d in _FLOAT_DTYPES]}")
            self._owner = owner

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient (module docstring); `closure` (torch's
        convention) is called first with grad enabled, its result returned.

        Raises:
            ValueError: a gradient changed after `clip_grad_norm_` took the norm, or one of another
                shape, dtype or device than its parameter.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner = self._owner
        assert owner is not None  # a torch optimizer has at least one parameter
        coef = self._clip_coefficient(owner)
        # every gradient checked and every update queued first, so a refused one changes nothing
        by_scalars: dict[tuple, tuple[Tensor, list]] = {}  # the step's scalars -> (s, pieces), in order
        advanced: list[tuple[dict, tuple[float, float]]] = []
        for group in self.param_groups:
            hyper = _hyper(group)
            for p in group["params"]:
                if p.grad is not None:
                    advanced.append((self.state[p], self._queue(p, hyper, by_scalars)))
        for s, pieces in by_scalars.values():  # each piece's own operands: the order changes no bit
            owner.backend.adamw_updates(pieces, coef, s)
        for st, pows in advanced:  # the counts move only once every update has run
            st["step"], st["beta1_pow"], st["beta2_pow"] = st["step"] + 1, *pows
        owner.clip = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's `zero_grad`; also drops a clip coefficient not applied (the step it was for is skipped)."""
        super().zero_grad(set_to_none=set_to_none)
        if self._owner is not None:
            self._owner.clip = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's `load_state_dict`, the FP32 state kept in FP32 (moved to each parameter's device)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            if i in saved:
                self.state[p] = {
                    k: v.to(p.device, copy=True) if isinstance(v, Tensor) else v for k, v in saved[i].items()
                }

    def _clip_coefficient(self, owner: ParallelState) -> Tensor:
        clip = owner.clip
        if clip is None:
            return torch.ones((), dtype=torch.float32, device=owner.device)
        # by the names the model's parameters had at the norm (one not among them: a name no norm took)
        params = [p for g in self.param_groups for p in g["params"]]
        grads = {
            clip.names.get(id(p), f"<parameter {k}: not the model's at the norm>"): p.grad for k, p in enumerate(params)
        }
        changed = clip.changed(grads)
        if changed:
            raise ValueError(
                f"gradients changed after clip_grad_norm_ ({changed[:3]}); allowed: clip after the last backward"
            )
        return clip.coef

    def _queue(self, p: Tensor, hyper: AdamWHyper, by_scalars: dict[tuple, tuple[Tensor, list]]) -> tuple[float, float]:
        """Check p's gradient, make p's state at its first step, queue its update's operands under the
        step's scalars; the beta powers its count moves to once the update has run."""
        g = p.grad
        if g.shape != p.shape or g.dtype not in _FLOAT_DTYPES or g.device != p.device:
            raise ValueError(
                f"gradient {list(g.shape)} {g.dtype} on {g.device}; allowed: {list(p.shape)}, bf16 or fp32, {p.device}"
            )
        st = self.state[p]
        if not st:
            master = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            master.copy_(p)  # bf16 -> fp32 widens exactly
            st.update(
                step=0,
                beta1_pow=1.0,
                beta2_pow=1.0,
                master=master,
                exp_avg=torch.zeros_like(master),
                exp_avg_sq=torch.zeros_like(master),
            )
        pows = next_beta_pows(hyper, (st["beta1_pow"], st["beta2_pow"]))
        key = (hyper, pows, p.device)
        if key not in by_scalars:
            by_scalars[key] = (step_scalars(hyper, *pows, p.device), [])
        by_scalars[key][1].append((st["master"], st["exp_avg"], st["exp_avg_sq"], g, p))
        return pows


def _hyper(group: dict[str, Any]) -> AdamWHyper:
    """A group's hyperparameters, checked (no clip here: clip_grad_norm_ gives the coefficient)."""
    return AdamWHyper(
        lr=group["lr"],
        betas=group["betas"],
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        max_grad_norm=math.inf,
    )
