"""The determinism contract `h3-parallel-v1`, as code.

1. Eight canonical reduction units. Unit j is heads [j*H/8, (j+1)*H/8) of to_q, to_k, to_v and
   the matching input columns of to_out.0; SwiGLU columns [j*F/8, (j+1)*F/8) of the hidden and
   gate halves of ff.net.0 and the matching input columns of ff.net.2; AdaLN output columns
   [j*18D/8, (j+1)*18D/8) of adaln_proj.linear.
2. A reduction that crosses units (row-parallel forward, dX of column-parallel projections, the
   q/k-norm weight gradients, d temb) is: FP32 partial per unit, then the fixed balanced tree
   ((u0+u1)+(u2+u3))+((u4+u5)+(u6+u7)), then one rounding. TP 2/4/8 ranks hold contiguous units
   and compute exactly the subtree of their units; the collective finishes the upper levels.
3. Inside a unit, and everywhere else, a reduction is a left-to-right FP32 chain in a documented
   order (GEMMs: k ascending; dX of fused weights: q,k,v / hidden,gate; rows: ascending
   `logical_keys`, padding dropped) or a balanced pairwise tree over a row-local vector
   (norm sums of squares, softmax denominators). No reduction order depends on the number of
   rows, on which rows share a call, on the layout or on the physical order of rows. A backend's
   kernel may cut a chain into fixed blocks of its axis, each its own chain, whose FP32 partials
   are then chained in the same order (sm90's attention dq: blocks of 128 keys, kernels/sm90.json);
   the blocks follow the axis index alone.
4. Every op computes in FP32 from its stored inputs and rounds once to its output dtype.
5. Strict mode fails closed: TF32 and reduced-precision reductions off; unsupported dtypes,
   shapes and devices raise `ValueError` instead of falling back.
6. Inputs are finite. A NaN or Inf in an active row of hidden_states or grad_out, in temb, in
   position_ids or in a weight loaded from a checkpoint raises `ValueError` (padding rows may hold
   anything: they reach no result). Rules 2-4 fix the bits of every finite result; IEEE 754 does
   not fix which NaN an op returns from NaN operands, and hardware differs, so the contract makes
   no claim about NaN bits and does not pretend to by computing on them. The checks run where
   inputs enter (PackedBatch construction, once per batch; the checkpoint loader), never inside the
   block step: a host check of finiteness is a device sync. A model call (forward, backward, a
   training step's gradients) reads its batches' checks with one sync as it ends, the first in
   program order refused (h3lab.finite.deferred_checks). Finite inputs can still give non-finite
   results (an overflow to Inf): every comparison counts non-finite elements on both sides
   (`h3lab.metrics.compare`), and a run's summary warns when the canonical result holds any, since
   a NaN compares equal to itself bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from h3lab.batch import ACTIVATION_DTYPES, SUPPORTED_DEVICES
from h3lab.config import NUM_UNITS
from h3lab.ops.fixed import unit_tree

CONTRACT_ID = "h3-parallel-v1"
TREE_SHAPE = "((u0+u1)+(u2+u3))+((u4+u5)+(u6+u7))"

__all__ = [
    "ACTIVATION_DTYPES",
    "CONTRACT_ID",
    "NUM_UNITS",
    "SUPPORTED_DEVICES",
    "TREE_SHAPE",
    "check_device",
    "check_strict_flags",
    "describe",
    "strict_mode",
    "unit_tree",
    "units_of_rank",
]


def units_of_rank(tp_rank: int, tp_size: int) -> range:
    """The canonical units tensor-parallel rank `tp_rank` of `tp_size` holds (contiguous)."""
    if tp_size not in (1, 2, 4, 8):
        raise ValueError(f"tp size {tp_size} not allowed; allowed: 1, 2, 4, 8 (subtrees of the 8-unit tree)")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp rank {tp_rank} out of range [0, {tp_size})")
    per = NUM_UNITS // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


def check_device(device: torch.device) -> None:
    if device.type not in SUPPORTED_DEVICES:
        raise ValueError(f"device {device} not supported in strict mode; allowed: {list(SUPPORTED_DEVICES)}")


def _tf32_state() -> dict[str, object]:
    return {
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
    }


@contextlib.contextmanager
def strict_mode() -> Iterator[None]:
    """Fail closed on TF32; switch reduced-precision reductions off for the duration (restored after).

    Raises:
        ValueError: TF32 is switched on. h3lab refuses to override a user's explicit TF32 choice
            silently: switch it off (`torch.backends.cuda.matmul.allow_tf32 = False`,
            `torch.set_float32_matmul_precision("highest")`).
    """
    state = _tf32_state()
    if state["torch.backends.cuda.matmul.allow_tf32"] or state["torch.get_float32_matmul_precision()"] != "highest":
        raise ValueError(f"strict mode forbids TF32, found {state}; allowed: allow_tf32=False, precision 'highest'")
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    try:
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


REDUCED_PRECISION_FLAGS = (
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
)


def reduced_precision_off() -> None:
    """Switch cuBLAS' reduced-precision reductions off for the process (torch's default is on). A model
    made deterministic in place (h3lab.parallelize) runs its forward and its backward at different
    moments of the user's program, so no `strict_mode` scope covers both: the flags stay off and
    `check_strict_flags` refuses a program that switches them on again."""
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False


def check_strict_flags(*, reductions: bool = True) -> None:
    """Refuse TF32 and (`reductions`) reduced-precision reductions, whoever switched them on.

    Raises:
        ValueError: naming the first flag that is on, and the value allowed.
    """
    state = _tf32_state()
    if state["torch.backends.cuda.matmul.allow_tf32"]:
        raise ValueError("strict mode: torch.backends.cuda.matmul.allow_tf32 is True; allowed: False (no TF32)")
    if state["torch.get_float32_matmul_precision()"] != "highest":
        precision = state["torch.get_float32_matmul_precision()"]
        raise ValueError(f"strict mode: float32 matmul precision {precision!r}; allowed: 'highest' (no TF32)")
    if not reductions:
        return
    matmul = torch.backends.cuda.matmul
    values = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    for flag, value in zip(REDUCED_PRECISION_FLAGS, values, strict=True):
        if value:  # torch also takes a tuple (allow, allow_splitk): any true part counts
            raise ValueError(f"strict mode: {flag} is {value!r}; allowed: False (no reduced-precision reduction)")


def describe() -> dict[str, object]:
    """The contract as data, recorded in every run's results."""
    return {
        "contract": CONTRACT_ID,
        "num_units": NUM_UNITS,
        "tree": TREE_SHAPE,
        "partials": "float32",
        "rounding": "one round-to-nearest-even per op output",
        "gemm_order": "k ascending, one FP32 chain per unit",
        "row_order": "ascending logical_keys, padding (first key < 0) dropped",
        "fused_dx_order": {"attn": "q,k,v", "ff.net.0": "hidden,gate"},
        "strict": {"tf32": False, "reduced_precision_reduction": False, "fallback": None},
        "nonfinite_inputs": "refused (active rows of hidden_states and grad_out, temb, position_ids, loaded weights)",
        "nonfinite_results": "counted in every comparison; the run summary warns",
    }
