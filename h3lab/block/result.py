"""`BlockResult`: what one block computes: the output, the input gradient and every weight gradient."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, eq=False)
class BlockResult:
    """Forward output, dX, dW (diffusers parameter names inside the block) and d temb.

    out, dx: [S, hidden] in the activation dtype; padding rows are zero.
    dw: e.g. `attn.to_q.weight`, `adaln_proj.linear.bias`, each in its parameter's dtype.
    dtemb: [T, time_embed_dim] float32, the gradient reaching the time embedder's output.
    """

    out: Tensor
    dx: Tensor
    dw: dict[str, Tensor]
    dtemb: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        """Flat view with the names runs use on disk: `out`, `dx`, `dtemb`, `dw.<parameter>`."""
        flat = {"out": self.out, "dx": self.dx}
        if self.dtemb is not None:
            flat["dtemb"] = self.dtemb
        flat.update({f"dw.{k}": v for k, v in self.dw.items()})
        return flat
