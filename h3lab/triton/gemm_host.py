"""The tiled GEMMs' host side, shared by their launchers (h3lab.triton.gemm, unit_gemm, unit_gemm_sm90)
and by the launchers that check their operands alike: the pinned configuration of "gemm" and
"unit_gemm" with the keys each may name, operand and device checks, persistent grids, and how TMA
descriptors walk the operands (the modes load_a, load_b and store_tile read). No kernel: nothing
here is compiled.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from h3lab.triton import configs

OPERAND_DTYPES = (torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float32)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "TMA")  # required
OPTIONAL_KEYS = {  # per kernel: a key another kernel reads (IMPL for mm, say) is a mistake, not a no-op
    "gemm": ("TMA_STORE", "EPILOGUE_SPLIT", "FLATTEN", "WARP_SPECIALIZE", "TAIL_M", "TAIL_N"),
    "unit_gemm": ("TMA_STORE", "EPILOGUE_SPLIT", "PENDING_IN_REGS", "SCRATCH_TMA", "IMPL", "LVL2_SMEM"),
}
INTERPRETER_PROGRAMS = 3  # fewer programs than tiles in the tests, so the persistent loop is exercised


def check_config(what: str, cfg: dict[str, Any], kernel: str) -> dict[str, Any]:
    """A configuration of `kernel` ("gemm" or "unit_gemm") must name every required key and nothing
    that kernel does not read (typos, or another kernel's keys, would pass silently)."""
    if kernel not in OPTIONAL_KEYS:
        raise ValueError(f"{what}: kernel {kernel!r}; allowed: {sorted(OPTIONAL_KEYS)}")
    optional = OPTIONAL_KEYS[kernel]
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    unknown = [k for k in cfg if k not in CONFIG_KEYS + optional]
    if missing or unknown:
        raise ValueError(
            f"{what} config: missing {missing}, unknown {unknown}; required {list(CONFIG_KEYS)}, "
            f"optional {list(optional)}"
        )
    if "TAIL_M" in cfg or "TAIL_N" in cfg:
        _check_tail(what, cfg)
    return cfg


def _check_tail(what: str, cfg: dict[str, Any]) -> None:
    """TAIL_M/TAIL_N (see tail_operands): both set, tl.dot-sized, fitting the row tile, without the
    loop forms the tail branch does not have."""
    tail_m, tail_n, BM, BN = cfg.get("TAIL_M"), cfg.get("TAIL_N"), cfg["BLOCK_M"], cfg["BLOCK_N"]
    pow2 = lambda v: isinstance(v, int) and v >= 16 and v & (v - 1) == 0  # noqa: E731  (tl.dot's smallest side)
    if not (pow2(tail_m) and pow2(tail_n) and tail_m <= BM and BN % tail_n == 0):
        raise ValueError(
            f"{what} config TAIL_M={tail_m}, TAIL_N={tail_n} with BLOCK_M={BM}, BLOCK_N={BN}; allowed: both set, "
            "powers of two >= 16, TAIL_M <= BLOCK_M, TAIL_N dividing BLOCK_N"
        )
    if cfg.get("FLATTEN") or cfg.get("WARP_SPECIALIZE"):
        raise ValueError(
            f"{what} config TAIL_M={tail_m}, TAIL_N={tail_n} with FLATTEN={cfg.get('FLATTEN')}, "
            f"WARP_SPECIALIZE={cfg.get('WARP_SPECIALIZE')}; allowed: both false (or absent) with the tail"
        )


def kernel_config(kernel: str, node: str, ieee: bool, rows: int | None = None) -> dict[str, Any]:
    """The pinned configuration of `kernel` on `node`; its "fp32" entries apply when an operand is fp32.

    A `by_rows` list ({"max_rows": n or null, ...overrides}) picks tile shapes by the row count M,
    as vLLM's batch-invariant tables do. Only BLOCK_M/N, warps, stages and the row tail (TAIL_M/N)
    may differ: BLOCK_K (the K order) must be the same in every bucket, and h3lab.bench.gemm_bench
    checks on the GPU that all pinned shapes give identical bits (one bit class) — the row-slice
    tests cross the bucket edge, and the tail's GPU test compares it with rows of a 4111-row call.
    """
    cfg = configs.pinned(kernel, node)
    fp32 = cfg.pop("fp32", {})
    buckets = cfg.pop("by_rows", [])
    cfg.pop("comment", None)
    if ieee:
        cfg.update(fp32)
    elif buckets and rows is not None:
        bucket = next(b for b in buckets if b["max_rows"] is None or rows <= b["max_rows"])
        if bucket.get("BLOCK_K", cfg["BLOCK_K"]) != cfg["BLOCK_K"]:
            raise ValueError(f"{node}.json {kernel!r}: a by_rows bucket changes BLOCK_K; allowed: {cfg['BLOCK_K']}")
        cfg.update({k: v for k, v in bucket.items() if k != "max_rows"})
    return check_config(f"{node}.json {kernel!r}", cfg, kernel)


def check_device(fn: str, *tensors: Tensor) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{fn}: operands on {sorted(map(str, devices))}; allowed: all on one device")
    device = devices.pop()
    if device.type != "cuda" and not (device.type == "cpu" and configs.interpreting()):
        raise ValueError(f"{fn}: operands on {device}; allowed: cuda (or cpu under TRITON_INTERPRET=1)")
    return device


def check_operand(fn: str, name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in OPERAND_DTYPES:
        raise ValueError(f"{fn}: {name} has dtype {t.dtype}; allowed: {list(OPERAND_DTYPES)}")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs(device: torch.device | str) -> int:
    """Programs a persistent grid may hold at once: the SMs (INTERPRETER_PROGRAMS in the interpreter)."""
    device = torch.device(device)
    return INTERPRETER_PROGRAMS if device.type == "cpu" else _sm_count(device)


def grid_size(device: torch.device, num_tiles: int) -> int:
    """A persistent grid: one program per SM (fewer when there are fewer tiles)."""
    return max(1, min(programs(device), num_tiles))


def tma_aligned(t: Tensor, major_stride: int) -> bool:
    """A TMA descriptor can walk t: 16-byte aligned base and major stride."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and (major_stride * size) % 16 == 0 and major_stride > 0


def a_mode(a_MK: Tensor) -> int:
    """How TMA can walk a: 1 = rows contiguous in K, 2 = columns contiguous in M, 0 = it cannot."""
    if a_MK.stride(1) == 1 and tma_aligned(a_MK, a_MK.stride(0)):
        return 1
    if a_MK.stride(0) == 1 and tma_aligned(a_MK, a_MK.stride(1)):
        return 2
    return 0


def b_mode(b_KN: Tensor) -> int:
    """How TMA can walk b: 1 = a weight W [N, K] seen as b = W.T, 2 = rows contiguous in N, 0 = it cannot."""
    if b_KN.stride(0) == 1 and tma_aligned(b_KN, b_KN.stride(1)):
        return 1
    if b_KN.stride(1) == 1 and tma_aligned(b_KN, b_KN.stride(0)):
        return 2
    return 0


def operand_a(a_MK: Tensor, block_m: int, block_k: int, tma: bool) -> tuple[int, TensorDescriptor | None]:
    """(mode, descriptor) for load_a: a_mode's, 0 = pointers (without TMA too)."""
    M, K = a_MK.shape
    mode = a_mode(a_MK) if tma else 0
    if mode == 1:
        return 1, TensorDescriptor(a_MK, [M, K], [a_MK.stride(0), 1], [block_m, block_k])
    if mode == 2:
        return 2, TensorDescriptor(a_MK, [K, M], [a_MK.stride(1), 1], [block_k, block_m])
    return 0, None


def operand_b(b_KN: Tensor, block_k: int, block_n: int, tma: bool) -> tuple[int, TensorDescriptor | None]:
    """(mode, descriptor) for load_b: b_mode's, 0 = pointers (without TMA too)."""
    K, N = b_KN.shape
    mode = b_mode(b_KN) if tma else 0
    if mode == 1:
        return 1, TensorDescriptor(b_KN, [N, K], [b_KN.stride(1), 1], [block_n, block_k])
    if mode == 2:
        return 2, TensorDescriptor(b_KN, [K, N], [b_KN.stride(0), 1], [block_k, block_n])
    return 0, None


def output_desc(c_MN: Tensor, block_m: int, block_n: int, cfg: dict[str, Any]) -> tuple[bool, int, Any]:
    """(OUT_TMA, SPLIT, descriptor) for store_tile: a TMA store when the config asks and rows are 16-byte aligned."""
    split = int(cfg.get("EPILOGUE_SPLIT", 1))
    if split not in (1, 2):
        raise ValueError(f"EPILOGUE_SPLIT={split}; allowed: 1, 2")
    if not cfg.get("TMA_STORE", False) or c_MN.stride(1) != 1 or not tma_aligned(c_MN, c_MN.stride(0)):
        return False, 1, None
    return True, split, TensorDescriptor(c_MN, list(c_MN.shape), [c_MN.stride(0), 1], [block_m, block_n // split])


def tail_operands(
    a_MK: Tensor, b_KN: Tensor, a_mode: int, b_mode: int, cfg: dict[str, Any], sms: int, out_dtype: torch.dtype
) -> tuple[int, int, TensorDescriptor | None, TensorDescriptor | None]:
    """(TAIL_M, TAIL_N, a's and W's tail descriptors) when the row tail rides on the row tiles, else Nones.

    It rides when the config names TAIL_M and TAIL_N, 0 < M % BLOCK_M <= TAIL_M, there are at least
    BLOCK_N // TAIL_N full row tiles to carry its slices, both operands go through TMA as a [M, K]
    and a weight W [N, K] (the forward's form), the output is bf16 (an fp32 tile's TMA staging
    buffer is 32 KiB, not 16: with the tail's 4 stages 237,632 bytes of shared memory, over sm90's
    232,448), and the plain tiling needs more than one round of the `sms` programs: where it fits
    in one, the tail only lengthens the tiles. Where both tilings need the same number of rounds
    past one, it still pays (one row tile fewer re-reads W), hence not a round count (the H200's
    timings at M = 264 and 520 that set the rule: commit e6448f9 and python -m h3lab.bench.gemm_bench).
    Otherwise the tail gets row tiles of its own: the same bits, only the tile computing them changes.
    `cfg` has passed check_config (mm's configs all do), which checks the TAIL keys, once per call.
    """
    tail_m, tail_n = cfg.get("TAIL_M"), cfg.get("TAIL_N")
    if tail_m is None and tail_n is None:
        return 1, 1, None, None
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    (M, K), N = a_MK.shape, b_KN.shape[1]
    plain_tiles = configs.cdiv(M, BM) * configs.cdiv(N, BN)
    carriers = M // BM  # full row tiles
    fits = out_dtype == torch.bfloat16 and a_mode == b_mode == 1
    if not (fits and 0 < M % BM <= tail_m and carriers >= BN // tail_n and plain_tiles > sms):
        return 1, 1, None, None
    w_NK = b_KN.t()
    a_tail = TensorDescriptor(a_MK, [M, K], [a_MK.stride(0), 1], [tail_m, BK])
    w_tail = TensorDescriptor(w_NK, [N, K], [w_NK.stride(0), 1], [tail_n, BK])
    return tail_m, tail_n, a_tail, w_tail
