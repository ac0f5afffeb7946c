"""The special-function instructions of the sm90 attention kernels, as exact functions of their inputs.

PLACEHOLDER. The models are fitted from the H200's answers to the SFU probe (h3lab.bench.sfu_probe)
on the branch that owns them (emulate-models); until they land, each function raises
NotImplementedError naming the missing model, so an emulated attention call fails loudly instead
of computing with a stand-in. The names and contracts the emulate-sm90 backend relies on:
- `ex2_approx_ftz(x)`: PTX ex2.approx.ftz.f32 (MUFU.EX2), what tl.math.exp2 compiles to;
- `rcp_approx(x)`: MUFU.RCP, the reciprocal inside div.full;
- `div_full(a, b)`: PTX div.full.f32, what Triton's `/` on FP32 compiles to (o = acc / l);
- `log2_libdevice(x)`: libdevice's __nv_log2f (tl.math.log2: lse = m + log2(l)), its fma.rn.ftz
  sequence as the PTX holds it.
Each takes FP32 tensors (broadcasting) and returns FP32 of the broadcast shape, elementwise, the
same bits on any device.
"""

from __future__ import annotations

from torch import Tensor


def _missing(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"the sm90 emulator has no exact model of {what} yet (h3lab.emulate.sfu is a placeholder until the "
        "fitted SFU models land); the attention kernels' bits cannot be emulated without it"
    )


def ex2_approx_ftz(x: Tensor) -> Tensor:
    """FP32 2^x as ex2.approx.ftz.f32 computes it (subnormal inputs and results flushed to +-0)."""
    raise _missing("ex2.approx.ftz.f32 (MUFU.EX2)")


def rcp_approx(x: Tensor) -> Tensor:
    """FP32 1/x as MUFU.RCP computes it."""
    raise _missing("MUFU.RCP")


def div_full(a: Tensor, b: Tensor) -> Tensor:
    """FP32 a / b as div.full.f32 computes it."""
    raise _missing("div.full.f32")


def log2_libdevice(x: Tensor) -> Tensor:
    """FP32 log2(x) as libdevice's __nv_log2f computes it."""
    raise _missing("libdevice's __nv_log2f")
