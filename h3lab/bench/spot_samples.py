"""Spot samples of real-shape backend calls: output elements with exactly the inputs that make them.

A sampler per Backend method (`SAMPLERS`) picks a few output elements and records them with the
slices of the inputs they depend on, so a CPU recomputes them from the sample alone (a real-shape
GEMM output element costs one dot product): 32 rows x 32 columns of a GEMM output with those rows
of a and columns of b, and at least GEMM_ELEMENTS of every GEMM call (one of few rows, as the
AdaLN GEMM's, takes every row and more columns), 8 query (or key) rows of two
heads of an attention call with every key and value (or query, dO and statistic) of those heads,
8 rows of a row-local op, 8 rows x 256 columns of an elementwise one, 16 columns of a row chain.
Rows include the first two and the last two (GEMM row tails, padding); the rest come from probe_rng,
the same for every call with the same extent, so shared operands are stored once. An operand that
is a view of a block weight is recorded by reference with the indices (`TensorStore.sliced`).

Dimension legend: M rows, K reduced, N columns, R rows, Q queries, K keys (attention), H heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from h3lab.bench.capture import encode
from h3lab.bench.probe_rng import Stream

GEMM_ROWS, GEMM_COLS, FEW_COLS = 32, 32, 8
GEMM_ELEMENTS = 1024  # at least this many elements of every GEMM call: a GEMM of few rows takes more columns
ATT_ROWS, ATT_HEADS, ROW_ROWS, ELEM_COLS, CHAIN_COLS = 8, 2, 8, 256, 16


def choose(n: int, k: int, salt: int) -> Tensor:
    """k indices of [0, n) (all if n <= k): the first two, the last two, the rest drawn; sorted, int64."""
    if n <= k:
        return torch.arange(n)
    drawn = Stream(salt * 1_000_003 + n).bits((4 * k,)) % n
    picked = torch.cat([torch.tensor([0, 1, n - 2, n - 1]), drawn]).unique(sorted=False)
    keep = []
    for i in picked.tolist():
        if i not in keep:
            keep.append(i)
        if len(keep) == k:
            break
    return torch.tensor(sorted(keep))


def gemm_cols(num_rows: int, least: int = GEMM_COLS) -> int:
    """How many columns a GEMM sample of `num_rows` rows takes: `least`, or more for GEMM_ELEMENTS."""
    return max(least, -(-GEMM_ELEMENTS // max(num_rows, 1)))


def _take(t: Tensor, dim: int, idx: Tensor) -> Tensor:
    return t.index_select(dim, idx.to(t.device))


def _gemm_elements(num_rows: int, num_cols: int) -> tuple[Tensor, Tensor]:
    """(rows, columns) of a GEMM output [num_rows, num_cols] a sample holds: GEMM_ROWS rows, and
    columns enough for GEMM_ELEMENTS (gemm_cols)."""
    rows = choose(num_rows, GEMM_ROWS, 1)
    return rows, choose(num_cols, gemm_cols(len(rows)), 2)


def _gemm(store, a: Tensor, b: Tensor, out: Tensor, a_dim: int) -> dict[str, Any]:
    """A sample of out = a (rows along a_dim) x b: those rows of a, those columns of b."""
    rows, cols = _gemm_elements(a.shape[a_dim], b.shape[1])
    sample = {"rows": rows.tolist(), "cols": cols.tolist()}
    sample |= {"a": store.sliced(a, a_dim, rows), "b": store.sliced(b, 1, cols)}
    return sample | {"out": store.put(_take(_take(out, 0, rows), 1, cols))}


def mm(store, args, kwargs, out) -> dict[str, Any]:
    """mm(a_MK, b_KN, out_dtype) and chain_mm(a_MK, b_KN): out [M, N]."""
    return _gemm(store, args[0], args[1], out, 0)


def mm_few_k(store, args, kwargs, out) -> dict[str, Any]:
    """mm_few_k(a_KM, b_KN, out_dtype): out [M, N] = a^T b."""
    return _gemm(store, args[0], args[1], out, 1)


def row_mm(store, args, kwargs, out) -> dict[str, Any]:
    """row_mm(a_RN, b_RK, order, out_dtype): out [N, K], the sum over rows in `order` of a[r]^T b[r]."""
    return _gemm(store, args[0], args[1], out, 1) | {"order": store.put(args[2])}


def unit_reduce(store, args, kwargs, out) -> dict[str, Any]:
    """unit_reduce(pieces, num_units): out [M, N] from pieces (a [M, U*Kp], b [U*Kp, N])."""
    pieces = args[0]
    rows, cols = _gemm_elements(out.shape[0], out.shape[1])
    sample = {"rows": rows.tolist(), "cols": cols.tolist(), "num_units": args[1]}
    sample["pieces"] = [{"a": store.sliced(a, 0, rows), "b": store.sliced(b, 1, cols)} for a, b in pieces]
    return sample | {"out": store.put(_take(_take(out, 0, rows), 1, cols))}


def unit_reduce_few_rows(store, args, kwargs, out) -> dict[str, Any]:
    """unit_reduce_few_rows(a_TK, b_KN, num_units): out [T, N], every one of the few rows."""
    a, b = args[0], args[1]
    cols = choose(b.shape[1], gemm_cols(a.shape[0], FEW_COLS), 2)
    sample = {"cols": cols.tolist(), "num_units": args[2], "a": store.put(a), "b": store.sliced(b, 1, cols)}
    return sample | {"out": store.put(_take(out, 1, cols))}


def _heads(H: int) -> Tensor:
    return choose(H, ATT_HEADS, 3)


def _qh(t: Tensor, rows: Tensor, heads: Tensor) -> Tensor:
    """[Q, H, Dh] -> the rows' heads, [rows, heads, Dh]."""
    return _take(_take(t, 0, rows), 1, heads)


def _stat(t: Tensor, heads: Tensor, rows: Tensor | None) -> Tensor:
    """[H, Q] -> [heads, rows] (every row when rows is None)."""
    t = _take(t, 0, heads)
    return t if rows is None else _take(t, 1, rows)


def attention_fwd(store, args, kwargs, out) -> dict[str, Any]:
    """attention_fwd(q, k, v, scale, out_dtype) -> (o, o_ref, stats): some queries of two heads, all keys."""
    q, k, v = args[0], args[1], args[2]
    rows, heads = choose(q.shape[0], ATT_ROWS, 4), _heads(q.shape[1])
    sample = {"rows": rows.tolist(), "heads": heads.tolist(), "scale": args[3]}
    sample |= {
        "q": store.put(_qh(q, rows, heads)),
        "k": store.put(_take(k, 1, heads)),
        "v": store.put(_take(v, 1, heads)),
    }
    o, o_ref, stats = out
    sample |= {"o": store.put(_qh(o, rows, heads)), "o_ref": store.put(_qh(o_ref, rows, heads))}
    return sample | {"stats": [store.put(_stat(s, heads, rows)) for s in stats]}


def attention_delta(store, args, kwargs, out) -> dict[str, Any]:
    """attention_delta(do, o_ref) -> delta [H, Q]: some queries, every head."""
    do, o_ref = args[0], args[1]
    rows = choose(do.shape[0], ATT_ROWS, 4)
    sample = {"rows": rows.tolist(), "do": store.put(_take(do, 0, rows)), "o_ref": store.put(_take(o_ref, 0, rows))}
    return sample | {"out": store.put(_take(out, 1, rows))}


def attention_bwd_q(store, args, kwargs, out) -> dict[str, Any]:
    """attention_bwd_q(q, do, stats, delta, k, v, scale) -> dq [Q, H, Dh]: some queries of two heads."""
    q, do, stats, delta, k, v = args[:6]
    rows, heads = choose(q.shape[0], ATT_ROWS, 4), _heads(q.shape[1])
    sample = {"rows": rows.tolist(), "heads": heads.tolist(), "scale": args[6]}
    sample |= {"q": store.put(_qh(q, rows, heads)), "do": store.put(_qh(do, rows, heads))}
    sample |= {
        "stats": [store.put(_stat(s, heads, rows)) for s in stats],
        "delta": store.put(_stat(delta, heads, rows)),
    }
    sample |= {"k": store.put(_take(k, 1, heads)), "v": store.put(_take(v, 1, heads))}
    return sample | {"out": store.put(_qh(out, rows, heads))}


def attention_bwd_kv(store, args, kwargs, out) -> dict[str, Any]:
    """attention_bwd_kv(q, do, stats, delta, k, v, scale) -> (dk, dv) [K, H, Dh]: some keys of two heads."""
    q, do, stats, delta, k, v = args[:6]
    rows, heads = choose(k.shape[0], ATT_ROWS, 5), _heads(q.shape[1])
    sample = {"rows": rows.tolist(), "heads": heads.tolist(), "scale": args[6]}
    sample |= {"q": store.put(_take(q, 1, heads)), "do": store.put(_take(do, 1, heads))}
    sample |= {
        "stats": [store.put(_stat(s, heads, None)) for s in stats],
        "delta": store.put(_stat(delta, heads, None)),
    }
    sample |= {"k": store.put(_qh(k, rows, heads)), "v": store.put(_qh(v, rows, heads))}
    return sample | {"out": [store.put(_qh(t, rows, heads)) for t in out]}


def attention_bwd(store, args, kwargs, out) -> dict[str, Any]:
    """attention_bwd(q, do, stats, delta, k, v, scale) -> (dq, dk, dv): attention_bwd_q's sample of dq
    under keys "dq.*" and attention_bwd_kv's of dk, dv under "kv.*" (the fused call gives their bytes)."""
    dq, dk, dv = out
    sample = {f"dq.{k}": v for k, v in attention_bwd_q(store, args, kwargs, dq).items()}
    return sample | {f"kv.{k}": v for k, v in attention_bwd_kv(store, args, kwargs, (dk, dv)).items()}


def _rowwise(store, args, kwargs, out, cols: int | None) -> dict[str, Any]:
    """Rows of every tensor whose first extent is the first tensor argument's (R): the rows, and for
    `cols` the columns too of every tensor shaped as that argument; other tensors whole up to 1 MiB."""
    first = next(t for t in args if isinstance(t, Tensor))
    R = first.shape[0] if first.dim() else -1  # a 0-d tensor: every tensor whole
    rows = choose(R, ROW_ROWS, 6)
    c = choose(first.shape[1], cols, 7) if cols and first.dim() == 2 else None

    def one(t: Tensor) -> dict[str, Any]:
        if t.dim() >= 1 and t.shape[0] == R:
            s = _take(t, 0, rows)
            return store.put(_take(s, 1, c) if c is not None and t.shape == first.shape else s)
        if t.numel() * t.element_size() <= 1 << 20:
            return store.put(t)
        return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}

    sample = {"rows": rows.tolist()} | ({"cols": c.tolist()} if c is not None else {})
    return sample | {"args": encode(list(args), one), "kwargs": encode(kwargs, one), "out": encode(out, one)}


def row_local(store, args, kwargs, out) -> dict[str, Any]:
    """Norms, RoPE and its tables: whole rows (each row's reduction needs all of it)."""
    return _rowwise(store, args, kwargs, out, None)


def elementwise(store, args, kwargs, out) -> dict[str, Any]:
    """SwiGLU, silu, the gated residual, the storage rounding: rows x columns."""
    return _rowwise(store, args, kwargs, out, ELEM_COLS)


def _flat_cols(t: Tensor, lead: int) -> tuple[Tensor, Tensor]:
    """t viewed [lead extents..., W]: (CHAIN_COLS of its W columns, their indices)."""
    flat = t.reshape(*t.shape[:lead], -1)
    cols = choose(flat.shape[-1], CHAIN_COLS, 8)
    return _take(flat, flat.dim() - 1, cols), cols


def chains(store, args, kwargs, out) -> dict[str, Any]:
    """row_sum, segment_sum, chain_sums: some columns of each summed tensor over every row (and of each
    sum), the row order and segments whole."""
    sample: dict[str, Any] = {
        "ints": [store.put(t) for t in args if isinstance(t, Tensor) and not t.is_floating_point()]
    }
    sample["scalars"] = [a for a in args if isinstance(a, int)]
    xs = [
        t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, Tensor) and t.is_floating_point()
    ]
    outs = [t for o in (out if isinstance(out, tuple) else (out,)) for t in (o if isinstance(o, list) else [o])]
    sample["x"] = []
    for x in xs:
        values, cols = _flat_cols(x, 1)
        sample["x"].append({"cols": cols.tolist(), "x": store.put(values)})
    sample["out"] = [
        store.put(_flat_cols(o, 0 if o.shape == x.shape[1:] else 1)[0]) for o, x in zip(outs, xs, strict=True)
    ]
    return sample


def whole(store, args, kwargs, out) -> dict[str, Any]:
    """plan_rows and its order: small index tensors, whole."""
    return {"args": encode(list(args), store.put), "kwargs": encode(kwargs, store.put), "out": encode(out, store.put)}


SAMPLERS: dict[str, Callable[..., dict[str, Any]]] = {
    "mm": mm,
    "chain_mm": mm,
    "mm_few_k": mm_few_k,
    "row_mm": row_mm,
    "unit_reduce": unit_reduce,
    "unit_reduce_few_rows": unit_reduce_few_rows,
    "attention_fwd": attention_fwd,
    "attention_delta": attention_delta,
    "attention_bwd_q": attention_bwd_q,
    "attention_bwd_kv": attention_bwd_kv,
    "attention_bwd": attention_bwd,
    "rms_modulate_fwd": row_local,
    "rms_modulate_bwd": row_local,
    "qk_norm_rope_fwd": row_local,
    "qk_norm_rope_bwd": row_local,
    "rope_tables": row_local,
    "swiglu_fwd": elementwise,
    "swiglu_bwd": elementwise,
    "gated_residual": elementwise,
    "silu": elementwise,
    "silu_bwd": elementwise,
    "round": elementwise,
    "row_sum": chains,
    "segment_sum": chains,
    "chain_sums": chains,
    "plan_rows": whole,
    "plan_rows()": whole,
}


class SpotRecorder:
    """Per call its method's spot sample (`SAMPLERS`), taken after the call: the methods a block calls
    never write their inputs. A method without a sampler is recorded by its arguments' shapes."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, []

    def begin(self, method: str, args: tuple, kwargs: dict) -> int:
        self.calls.append({"index": len(self.calls), "method": method})
        return len(self.calls) - 1

    def end(self, index: int, args: tuple, kwargs: dict, out: Any) -> None:
        method = self.calls[index]["method"]
        sampler = SAMPLERS.get(method)
        if sampler is None:
            self.calls[index]["unsampled"] = [list(t.shape) for t in args if isinstance(t, Tensor)]
            return
        self.calls[index] |= sampler(self.store, args, kwargs, out)
