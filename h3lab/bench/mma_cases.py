"""The MMA probe's cases: the kernels' tl.dot tiles, and recipes of inputs that any device draws alike.

A `Tile` is one tl.dot configuration of the kernels: BLOCK_M x BLOCK_N outputs over BLOCK_K chunks
on some warps, b given transposed or not (a weight as W.T, keys as k^T), a from shared memory or
from registers (attention's p.to(bf16) and dS). `kernel_tiles` reads them from the pinned file
(kernels/sm90.json), so the probe follows the kernels; `ISSUE_TILE` is issue 31's 64x64 tile and
`fma_tiles` the IEEE FP32 dots (the fp32 GEMM entry, the few-row AdaLN kernel).

A `Case` runs one recipe over `tiles` independent tiles of one Tile at one K with one accumulator
mode ("none": tl.dot without acc first, as attention's q k^T; "zeros": acc = tl.zeros, then the
chain; "load": acc read from memory, as a chain that continues). Its inputs come from probe_rng
with the case's seed: the GPU draws them, a CPU draws them again to check offline. Recipes:
`random` (exponent spreads 0 to 2^30, accumulators far below to far above the products, zeros),
and the adversarial ones in `ADVERSARIAL`.

Dimension legend: T tiles, M = BLOCK_M rows, N = BLOCK_N columns, K reduced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from h3lab.bench.probe_rng import Stream
from h3lab.emulate.floats import format_of, from_fields
from h3lab.triton import configs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ACC_MODES = ("none", "zeros", "load")
SPREADS = (0, 1, 3, 6, 12, 20, 30)  # half-widths of a tile's exponent range, cycled over tiles
OFFSETS = (-30, -8, 0, 8, 30)  # where a tile's accumulators sit against its products, cycled


@dataclass(frozen=True)
class Tile:
    name: str
    BM: int
    BN: int
    BK: int
    warps: int
    b_trans: bool  # b stored [N, K] and fed as its transpose (W.T, k^T)
    a_regs: bool  # a converted in registers before the dot (p.to(bf16)), not straight from memory
    sites: str  # which kernel dots it stands for


ISSUE_TILE = Tile("issue_64x64", 64, 64, 16, 4, False, False, "issue 31's H200 measurement (64x64 tile)")


def kernel_tiles(node: str = "sm90") -> list[Tile]:
    """The tensor-core tl.dot tiles of the pinned kernels, each (shape, warps, operand form) once."""
    g, u = configs.pinned("gemm", node), configs.pinned("unit_gemm", node)
    small = next(b for b in g["by_rows"] if b["max_rows"] is not None)
    out = [
        Tile("gemm", g["BLOCK_M"], g["BLOCK_N"], g["BLOCK_K"], g["num_warps"], True, False, "mm, rows > 1024"),
        Tile("gemm_small", small["BLOCK_M"], small["BLOCK_N"], g["BLOCK_K"], small["num_warps"], True, False, "mm"),
        Tile("gemm_tail", small["TAIL_N"], small["TAIL_M"], g["BLOCK_K"], small["num_warps"], True, False, "tail"),
        Tile("unit_wt", u["BLOCK_M"], u["BLOCK_N"], u["BLOCK_K"], u["num_warps"], True, False, "unit_mm, b = W.T"),
        Tile("unit_kn", u["BLOCK_M"], u["BLOCK_N"], u["BLOCK_K"], u["num_warps"], False, False, "unit_mm, b = W"),
    ]
    for dh in (32, 128):
        f = configs.pinned("attention_fwd", node)["by_head_dim"][str(dh)]
        q = configs.pinned("attention_bwd_q", node)["by_head_dim"][str(dh)]
        kv = configs.pinned("attention_bwd_kv", node)["by_head_dim"][str(dh)]
        out += [
            Tile(f"att{dh}_qk", f["BLOCK_M"], f["BLOCK_N"], dh, f["num_warps"], True, False, "fwd q k^T"),
            Tile(f"att{dh}_pv", f["BLOCK_M"], dh, f["BLOCK_N"], f["num_warps"], False, True, "fwd p v"),
            Tile(f"att{dh}_q_s", q["BLOCK_M"], q["BLOCK_N"], dh, q["num_warps"], True, False, "dq: q k^T, dO v^T"),
            Tile(f"att{dh}_q_dq", q["BLOCK_M"], dh, q["BLOCK_N"], q["num_warps"], False, True, "dq: dS k"),
            Tile(f"att{dh}_kv_s", kv["BLOCK_N"], kv["BLOCK_M"], dh, kv["num_warps"], True, False, "dkv: k q^T"),
            Tile(f"att{dh}_kv_dkv", kv["BLOCK_N"], dh, kv["BLOCK_M"], kv["num_warps"], False, True, "dkv: P^T dO"),
        ]
    return _dedupe(out)


def _dedupe(tiles: list[Tile]) -> list[Tile]:
    seen: dict[tuple, Tile] = {}
    for t in tiles:
        key = (t.BM, t.BN, t.BK, t.warps, t.b_trans, t.a_regs)
        seen[key] = replace(seen[key], sites=f"{seen[key].sites}; {t.name}: {t.sites}") if key in seen else t
    return list(seen.values())


def fma_tiles(node: str = "sm90") -> list[Tile]:
    """The IEEE FP32 tl.dot tiles (FMA chains): the fp32 GEMM entry and the few-row d temb kernel."""
    g, f = configs.pinned("gemm", node)["fp32"], configs.pinned("few_rows", node)
    return [
        Tile("gemm_fp32", g["BLOCK_M"], g["BLOCK_N"], g["BLOCK_K"], g["num_warps"], False, False, "mm fp32"),
        Tile("few_rows", 16, f["BLOCK_N"], f["BLOCK_K"], f["num_warps"], False, False, "unit_mm_few_rows"),
    ]


# ---- drawing values ------------------------------------------------------------------------------


def values(s: Stream, shape: tuple[int, ...], lo, hi, dtype: torch.dtype, zeros: int = 0) -> Tensor:
    """Random-signed normal values with exponents uniform in [lo, hi] (ints or tensors broadcasting to
    `shape`, clamped to the normal range), random fractions; one in `zeros` (if set) is +-0."""
    fmt = format_of(dtype)
    sign = s.bits(shape) & 1
    exp = lo + s.bits(shape) % (torch.as_tensor(hi) - lo + 1)
    field = (exp + fmt.bias).clamp(1, 2 * fmt.bias)
    frac = s.bits(shape) & ((1 << fmt.frac_bits) - 1)
    if zeros:
        field = torch.where(s.bits(shape) % zeros == 0, 0, field)
        frac = torch.where(field == 0, 0, frac)
    return from_fields(sign, field, frac, dtype)


def tile_params(s: Stream, T: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per tile [T, 1, 1]: exponent spread, a's and b's base exponents, the accumulators' offset."""
    t = torch.arange(T, device=s.device).view(T, 1, 1)
    spread = torch.tensor(SPREADS, device=s.device)[t % len(SPREADS)]
    offset = torch.tensor(OFFSETS, device=s.device)[t % len(OFFSETS)]
    return spread, s.ints((T, 1, 1), -20, 20), s.ints((T, 1, 1), -20, 20), offset


Recipe = Callable[[Stream, int, int, int, int, torch.dtype], tuple[Tensor, Tensor, Tensor]]


def random_recipe(s: Stream, T: int, M: int, N: int, K: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(a [T, M, K], b [T, K, N], c [T, M, N] FP32): spreads and offsets cycled over tiles, 1 in 8 c zero."""
    spread, ea, eb, offset = tile_params(s, T)
    a = values(s, (T, M, K), ea - spread, ea + spread, dtype)
    b = values(s, (T, K, N), eb - spread, eb + spread, dtype)
    top = ea + eb + offset
    c = values(s, (T, M, N), top - spread - 4, top + spread + 4, torch.float32, zeros=8)
    return a, b, c


# ---- adversarial recipes (each [T, M, K], [T, K, N], [T, M, N]; K a multiple of 16) ----------------


def _groups(x: Tensor) -> Tensor:
    """x [..., K] viewed as [..., K/16, 16]: the products of one MMA step."""
    return x.unflatten(-1, (x.shape[-1] // 16, 16))


def cancel_recipe(s, T, M, N, K, dtype):
    """Products cancelling in pairs inside each step (a[k+8] = -a[k], b[k+8] = b[k]) but for one small
    product per step; accumulators well below the big products: what survives is truncated."""
    a = values(s, (T, M, K), -4, 4, dtype)
    b = values(s, (T, K, N), -4, 4, dtype)
    ag, bg = _groups(a), _groups(b.transpose(1, 2))  # views: writes land in a and b
    ag[..., 8:15] = -ag[..., 0:7]
    bg[..., 8:15] = bg[..., 0:7]
    ag[..., 15] = values(s, ag[..., 15].shape, -30, -8, dtype)
    c = values(s, (T, M, N), -30, 0, torch.float32, zeros=4)
    return a, b, c


def spread30_recipe(s, T, M, N, K, dtype):
    """Products 2^30 apart inside a step (a's exponents alternate), accumulators in between or zero."""
    base = s.ints((T, 1, 1), -5, 5)
    k = torch.arange(K, device=s.device)
    a = values(s, (T, M, K), base - 30 * (k % 2), base - 30 * (k % 2), dtype)
    b = values(s, (T, K, N), -2, 2, dtype)
    c = values(s, (T, M, N), base - 15, base - 5, torch.float32, zeros=3)
    return a, b, c


def subnormal_inputs_recipe(s, T, M, N, K, dtype):
    """Every other a subnormal (exponent field 0), the rest tiny normals; b up to 2^60: products that
    stay normal in FP32, from inputs that are not."""
    fmt = format_of(dtype)
    a = values(s, (T, M, K), fmt.emin, fmt.emin + 20, dtype)
    sub = from_fields(
        s.bits((T, M, K)) & 1, torch.zeros((), dtype=torch.int64), s.ints((T, M, K), 1, (1 << fmt.frac_bits) - 1), dtype
    )
    a = torch.where(torch.arange(K, device=s.device) % 2 == 0, sub, a)
    b = values(s, (T, K, N), 0, 60, dtype)
    c = values(s, (T, M, N), -100, -60, torch.float32, zeros=2)
    return a, b, c


def subnormal_products_recipe(s, T, M, N, K, dtype):
    """Products between 2^-156 and 2^-124 (across the bottom of FP32's normal range), accumulators
    zero, subnormal or just normal: results in the subnormal range, across its edge and below it."""
    a = values(s, (T, M, K), -78, -62, dtype)
    b = values(s, (T, K, N), -78, -62, dtype)
    zero = torch.zeros((), dtype=torch.int64)
    sub = from_fields(s.bits((T, M, N)) & 1, zero, s.ints((T, M, N), 1, (1 << 23) - 1), torch.float32)
    c = torch.where(s.bits((T, M, N)) % 3 == 0, sub, values(s, (T, M, N), -126, -120, torch.float32, zeros=2))
    return a, b, c


def big_accumulator_recipe(s, T, M, N, K, dtype):
    """Accumulators 2^20 to 2^40 above the products: each step truncates the products to its grid."""
    a = values(s, (T, M, K), -4, 4, dtype)
    b = values(s, (T, K, N), -4, 4, dtype)
    return a, b, values(s, (T, M, N), 20, 40, torch.float32)


def overflow_recipe(s, T, M, N, K, dtype):
    """Products near 2^120-2^128 (mostly positive: their sums pass FLT_MAX) and accumulators near FLT_MAX."""
    a = values(s, (T, M, K), 55, 64, dtype).abs()
    b = values(s, (T, K, N), 55, 64, dtype).abs()
    b = torch.where(s.bits((T, K, N)) % 8 == 0, -b, b)
    c = values(s, (T, M, N), 120, 127, torch.float32)
    return a, b, c


def specials_recipe(s, T, M, N, K, dtype):
    """Random values with +inf, -inf, NaNs (random payloads) and zeros sprinkled into a, b and c."""
    a, b, c = random_recipe(s, T, M, N, K, dtype)
    return _sprinkle(s, a, 48), _sprinkle(s, b, 48), _sprinkle(s, c, 16)


def _sprinkle(s: Stream, x: Tensor, one_in: int) -> Tensor:
    fmt = format_of(x.dtype)
    pick = s.bits(x.shape) % (one_in * 4)
    top = torch.full(x.shape, (1 << fmt.exp_bits) - 1, dtype=torch.int64, device=x.device)
    payload = s.ints(x.shape, 1, (1 << fmt.frac_bits) - 1)
    inf_pos = from_fields(torch.zeros_like(top), top, torch.zeros_like(top), x.dtype)
    nan = from_fields(s.bits(x.shape) & 1, top, payload, x.dtype)
    x = torch.where(pick == 0, inf_pos, torch.where(pick == 1, -inf_pos, x))
    return torch.where(pick == 2, nan, torch.where(pick == 3, x * 0, x))


def signed_zero_recipe(s, T, M, N, K, dtype):
    """Zero sums of four kinds by row (m % 4): every product -0; products +0 and -0 mixed; x - x
    cancelling in pairs; -0 products beside random c. Accumulators +0 and -0 by column parity."""
    a = values(s, (T, M, K), -4, 4, dtype)
    b = values(s, (T, K, N), -4, 4, dtype).abs()
    kind = torch.arange(M, device=s.device).view(1, M, 1) % 4
    neg0 = -torch.zeros_like(a)
    mixed = torch.where(s.bits(a.shape) % 2 == 0, neg0, torch.zeros_like(a))
    pairs = _groups(a.clone())
    pairs[..., 8:] = -pairs[..., :8]
    b_pairs = _groups(b.transpose(1, 2))  # a view: writes land in b
    b_pairs[..., 8:] = b_pairs[..., :8]
    a = torch.where(kind == 0, neg0, torch.where(kind == 1, mixed, torch.where(kind == 2, pairs.flatten(-2), neg0)))
    col = torch.arange(N, device=s.device).view(1, 1, N) % 2
    c = torch.where(col == 0, torch.zeros((T, M, N), device=s.device), -torch.zeros((T, M, N), device=s.device))
    c = torch.where(kind == 3, values(s, (T, M, N), -4, 4, torch.float32), c)
    return a, b, c


ADVERSARIAL: dict[str, Recipe] = {
    "cancel": cancel_recipe,
    "spread30": spread30_recipe,
    "subnormal_inputs": subnormal_inputs_recipe,
    "subnormal_products": subnormal_products_recipe,
    "big_accumulator": big_accumulator_recipe,
    "overflow": overflow_recipe,
    "specials": specials_recipe,
    "signed_zero": signed_zero_recipe,
}
RECIPES: dict[str, Recipe] = {"random": random_recipe, **ADVERSARIAL}


# ---- the cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    tile: Tile
    dtype: str  # DTYPES key: bf16/fp16 run on the tensor cores, fp32 as an IEEE FMA chain
    acc: str  # ACC_MODES
    K: int
    tiles: int
    recipe: str  # RECIPES key
    seed: int

    def inputs(self, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
        """(a [T, M, K], b [T, K, N], c [T, M, N] FP32), drawn from the seed on `device` (same bits anywhere)."""
        s = Stream(self.seed, device)
        return RECIPES[self.recipe](s, self.tiles, self.tile.BM, self.tile.BN, self.K, DTYPES[self.dtype])

    @property
    def dots(self) -> int:
        return self.tiles * self.tile.BM * self.tile.BN

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "tile"} | {"tile": self.tile.__dict__}

    @classmethod
    def from_dict(cls, d: dict) -> Case:
        fields = {k: d[k] for k in ("name", "dtype", "acc", "K", "tiles", "recipe", "seed")}
        return cls(tile=Tile(**d["tile"]), **fields)


def _per(target: int, tile: Tile) -> int:
    return max(1, round(target / (tile.BM * tile.BN)))


def probe_cases(node: str = "sm90", seed_base: int = 1000) -> list[Case]:
    """Every case of the probe, each with its own seed (seed_base + its index: another base draws
    fresh inputs for every case, a check of the model on data it was not fitted to): >= 10^6 random
    dots over the kernels' tiles (K of one chunk, five chunks and 2088 = 32 x 64 + a tail of 40),
    issue 31's tile in every accumulator mode, fp16, the IEEE FP32 tiles, and each adversarial
    recipe on two tiles."""
    specs: list[tuple[str, Tile, str, str, int, int, str]] = []
    for tile in kernel_tiles(node):
        for K, target in ((tile.BK, 40_000), (5 * tile.BK, 40_000), (2088, 16_000)):
            specs.append((f"random.{tile.name}.k{K}", tile, "bf16", "load", K, _per(target, tile), "random"))
        if tile.b_trans and tile.name.startswith("att"):  # q k^T: no accumulator on the first step
            specs.append(
                (f"random.{tile.name}.k{tile.BK}.none", tile, "bf16", "none", tile.BK, _per(40_000, tile), "random")
            )
    for K in (16, 32, 64):
        for acc in ACC_MODES:
            specs.append((f"issue.k{K}.{acc}", ISSUE_TILE, "bf16", acc, K, 6, "random"))
    specs.append(("random.issue.k40_tail", ISSUE_TILE, "bf16", "load", 40, 6, "random"))
    specs.append(("random.gemm.k40_tail", kernel_tiles(node)[0], "bf16", "load", 40, 1, "random"))
    for K in (64, 2088):
        specs.append((f"fp16.issue.k{K}", ISSUE_TILE, "fp16", "load", K, 10 if K == 64 else 4, "random"))
    for tile in fma_tiles(node):
        for K in (tile.BK, 5 * tile.BK, 2088):
            specs.append((f"fp32.{tile.name}.k{K}", tile, "fp32", "load", K, _per(20_000, tile), "random"))
    for recipe in ADVERSARIAL:
        for acc in ACC_MODES:
            specs.append((f"{recipe}.issue.{acc}", ISSUE_TILE, "bf16", acc, 64, 1, recipe))
        specs.append((f"{recipe}.gemm.load", kernel_tiles(node)[0], "bf16", "load", 64, 1, recipe))
    return [Case(n, t, d, a, K, T, r, seed=seed_base + i) for i, (n, t, d, a, K, T, r) in enumerate(specs)]
