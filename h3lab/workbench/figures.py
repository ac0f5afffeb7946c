"""The pictures: a layout x tensor heatmap of the verdicts, a per-element ULP map of one tensor, and
the op-by-op first-divergence timeline of a traced run.

All use discrete bins, never a continuous scale: ULP distances fall in power-of-two bins
[0, 1, 2, 4, ..., 2^16, beyond), errors at the tensor's RMS in [0, (0, 1), 1, 2, ..., 2^16, beyond)
and fractions of differing elements in [0, <2^-12, 2^-12, ..., 1/2, 1]. The first colour, a
neutral grey, is reserved for "bit-identical"; a layout that left no result is drawn in FAILED.

The heatmap headlines what can be read: the largest error in ULPs at the tensor's RMS and the 99th
percentile of the ULP distance (h3lab.metrics: sign flips of elements near zero, whose ULP
distance counts every float around zero, are counted apart). The maximum ULP distance, set by those
flips, is one table away (`tables.drift_table`). Per-element maps draw sign flips in their own
colour, SIGN_FLIP, outside the ULP scale.

Cells are drawn with imshow(interpolation="nearest"): the default antialiasing blends neighbouring
cells when a map is down-sampled, which would paint identical cells as different. Figures are
matplotlib `Figure` objects (no pyplot state): `show()` saves and displays.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib.axes import Axes
from matplotlib.colors import BoundaryNorm, ListedColormap, to_rgba
from matplotlib.figure import Figure
from torch import Tensor

from h3lab.metrics import NAN_MISMATCH, bit_pattern, error_stats, sign_flips, ulp_map

IDENTICAL = to_rgba("#d9d9d9")  # neutral grey: bit-identical, and nothing else
FAILED = to_rgba("#3b3b3b")  # no result: the layout failed or the value is missing
SIGN_FLIP = to_rgba("#2c7fb8")  # blue, outside the yellow-red scale: an element whose sign flipped near zero
ULP_EDGES = np.array([0, 1] + [2**k for k in range(1, 17)] + [2**62], dtype=np.float64)  # last bin: >= 2^16
# an error at the RMS below one ULP is a difference too (a flip near zero): the first colour bin is (0, 1)
RMS_EDGES = np.array([0, 1e-300] + [2.0**k for k in range(0, 17)] + [2.0**62])
FRAC_EDGES = np.array([0, 1e-12] + [2.0**k for k in range(-12, 1)] + [1 + 1e-9])  # 1e-12 < 1/numel of any tensor
MAX_CELLS = 512  # per-element maps larger than this per side show the max over blocks


def binned_cmap(edges: np.ndarray, sequential: str = "YlOrRd") -> tuple[ListedColormap, BoundaryNorm]:
    """A ListedColormap with IDENTICAL first and one sequential colour per further bin, and its BoundaryNorm."""
    import matplotlib

    n = len(edges) - 1
    seq = matplotlib.colormaps[sequential](np.linspace(0.12, 1.0, n - 1))  # 0.12: the palest yellow still reads
    cmap = ListedColormap([IDENTICAL, *seq], name=f"h3lab-{sequential}-{n}").with_extremes(bad=FAILED)
    return cmap, BoundaryNorm(edges, n)


def _frac_cell(equal: object, frac: object) -> float:
    if pd.isna(equal):
        return np.nan
    if bool(equal):
        return 0.0
    return float(FRAC_EDGES[1]) if pd.isna(frac) else float(frac)  # digest-only: the first bin, labelled "≠"


def _ulp_cell(equal: object, max_ulp: object) -> float:
    if pd.isna(equal):
        return np.nan
    # bits that differ by 0 ULP (+0 vs -0, a NaN payload) still differ: they go in the first non-identical bin;
    # so does a digest-only verdict (`h3lab run --digests`), which knows that bits differ but not by how much
    if bool(equal):
        return 0.0
    return 1.0 if pd.isna(max_ulp) else float(max(int(max_ulp), 1))


def _rms_cell(equal: object, at_rms: object) -> float:
    if pd.isna(equal):
        return np.nan
    if bool(equal):
        return 0.0
    return float(RMS_EDGES[1]) if pd.isna(at_rms) else max(float(at_rms), float(RMS_EDGES[1]))


DIGEST_ONLY, FLIPS_ONLY = 1.0, 2.0  # why a differing cell has no value: the marks `_labels` draws


def _unknown(verdicts: pd.DataFrame, column: str) -> pd.Series:
    """Per row, why its bits differ but its record lacks `column`: DIGEST_ONLY for a digest-only
    verdict (`h3lab run --digests`) or a record older than the field, labelled "≠"; FLIPS_ONLY where
    every differing element is a sign flip near zero (no ULP distance to take a percentile of),
    labelled "±0"; else 0. Either is drawn in the first bin."""
    differs = verdicts["bitwise_equal"].eq(False).fillna(False).astype(bool)
    missing = verdicts[column].isna() if column in verdicts else pd.Series(True, index=verdicts.index)
    flips = verdicts["sign_flips"].fillna(0).gt(0) if "sign_flips" in verdicts else pd.Series(False, verdicts.index)
    sized = verdicts["max_ulp"].notna() if "max_ulp" in verdicts else pd.Series(False, index=verdicts.index)
    only_flips = differs & missing & flips.astype(bool) & sized.astype(bool)
    return (differs & missing).astype(float) * DIGEST_ONLY + only_flips.astype(float) * (FLIPS_ONLY - DIGEST_ONLY)


def _digest_only(verdicts: pd.DataFrame) -> pd.Series:
    """Rows whose bits differ but whose verdict is a digest (`h3lab run --digests`): no ULP, no fraction."""
    return _unknown(verdicts, "max_ulp") == DIGEST_ONLY


def _labels(values: np.ndarray, unknown: np.ndarray, label, first_bin: float) -> list[list[str]]:
    """Each cell's text: its value's label, or the mark of why it has none (`_unknown`) where the cell
    holds only the first-bin placeholder (another seed or unit slice may have given it a value)."""

    def text(x: float, u: float) -> str:
        if u in (DIGEST_ONLY, FLIPS_ONLY) and x <= first_bin:
            return "≠" if u == DIGEST_ONLY else "±0"
        return label(x)

    return [[text(x, u) for x, u in zip(row, urow, strict=True)] for row, urow in zip(values, unknown, strict=True)]


def _short(tensor: str) -> str:
    return ("dW " + tensor[3:].removesuffix(".weight")) if tensor.startswith("dw.") else tensor


def _ulp_label(v: float) -> str:
    if v < 1:
        return "<1"
    return f"{v:.0f}" if v < 1e4 else f"{v / 1e3:.0f}k" if v < 1e6 else f"{v / 1e6:.0f}M"


def _edge_label(e: float) -> str:
    if e < 1:
        return "0" if e == 0 else f"2^{int(np.log2(e))}" if e >= 2**-12 else ""
    return f"{e:.0f}" if e < 1024 else f"2^{int(np.log2(e))}"


def _panel(ax: Axes, values: np.ndarray, edges: np.ndarray, labels: list[list[str]] | None) -> object:
    cmap, norm = binned_cmap(edges)
    im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, interpolation="nearest", aspect="auto")
    if labels is not None:
        for (i, j), text in np.ndenumerate(np.array(labels, dtype=object)):
            if text:  # only differing cells: identical ones stay plain grey
                dark = norm(values[i, j]) > 0.6 * cmap.N
                ax.text(j, i, text, ha="center", va="center", fontsize=6, color="white" if dark else "black")
    return im


# the heatmap's panel rows: verdict column, cell function, bins, title, colorbar label, cell label
HEATMAP_ROWS = (
    ("max_ulp_at_rms", _rms_cell, RMS_EDGES, "max error, ULPs at RMS", lambda x: _ulp_label(x) if x > 0 else ""),
    ("ulp_p99", _ulp_cell, ULP_EDGES, "p99 ULP", lambda x: _ulp_label(x) if x > 0 else ""),
    ("frac_differing", _frac_cell, FRAC_EDGES, "fraction differing", lambda x: _frac_label(x)),
)


def _frac_label(x: float) -> str:
    return "" if not x > 0 else "<1%" if x < 0.01 else f"{100 * x:.0f}%"


def _cells(v: pd.DataFrame, layouts: list[str], tensors: list[str], column: str, cell) -> tuple[np.ndarray, ...]:
    """(values, unknown) as layout x tensor arrays, the worst over seeds and runs."""
    values = v[column] if column in v else pd.Series(pd.NA, index=v.index)
    frame = v.assign(
        value=[cell(e, x) for e, x in zip(v["bitwise_equal"], values, strict=True)],
        unknown=_unknown(v, column),
    )
    return tuple(
        frame.pivot_table(index="layout", columns="tensor", values=c, aggfunc="max", dropna=False)
        .reindex(index=layouts, columns=tensors)
        .to_numpy(dtype=float)
        for c in ("value", "unknown")
    )


def verdict_heatmap(verdicts: pd.DataFrame, title: str = "") -> Figure:
    """Layout x tensor, one column per mode: the largest error in ULPs at the tensor's RMS, p99 ULP and
    the fraction of differing elements (HEATMAP_ROWS).

    Args:
        verdicts: `tables.verdict_frame` rows (several seeds or runs: the worst value per cell).
        title: the figure's title.

    Returns:
        The figure; its axes are titled "<row title> | <mode>".
    """
    if verdicts.empty:
        raise ValueError("no verdicts to draw; allowed: a non-empty tables.verdict_frame")
    modes = [m for m in ("deterministic", "baseline") if m in set(verdicts["mode"])]
    layouts = list(dict.fromkeys(verdicts["layout"]))
    tensors = list(dict.fromkeys(verdicts["tensor"]))
    n = len(HEATMAP_ROWS)
    # inches: 0.34 per tensor column and 0.3 per layout row keep 6-pt cell labels legible; 2.0 holds the tensor
    # names and titles; a panel gets at least 2.2 so its colorbar's 19 bin labels do not overlap
    # at least 8 wide: the two title lines fit above a heatmap of few columns (a trajectory has 6)
    fig = Figure(
        figsize=(max(8.0, 2.4 + 0.34 * len(tensors) * len(modes)), 2.0 + n * max(2.2, 0.5 + 0.3 * len(layouts)))
    )
    fig.set_layout_engine("constrained")
    axes = fig.subplots(n, len(modes), squeeze=False, sharex=True, sharey=True)
    marks: set[float] = set()
    for col, mode in enumerate(modes):
        v = verdicts[verdicts["mode"] == mode]
        for row, (column, cell, edges, what, label) in enumerate(HEATMAP_ROWS):
            values, unknown = _cells(v, layouts, tensors, column, cell)
            marks |= set(np.unique(np.nan_to_num(unknown)).tolist())
            im = _panel(axes[row, col], values, edges, _labels(values, unknown, label, float(edges[1])))
            axes[row, col].set_title(f"{what} | {mode}", fontsize=9)
            axes[row, col].set_yticks(range(len(layouts)), layouts, fontsize=8)
            if col == len(modes) - 1:
                cb = fig.colorbar(im, ax=axes[row, :].tolist(), spacing="uniform", ticks=edges[:-1], aspect=12)
                cb.ax.set_yticklabels([_edge_label(e) for e in edges[:-1]], fontsize=6)
                cb.set_label(what, fontsize=7)
        axes[-1, col].set_xticks(range(len(tensors)), [_short(t) for t in tensors], rotation=90, fontsize=7)
    fig.suptitle(
        (title or "every layout against the single-process block of the same mode")
        + "\ngrey: bit-identical; dark: no result; p99 over the differing elements, sign flips near zero apart"
        + ("; ≠: bits differ, size not recorded (digests)" if DIGEST_ONLY in marks else "")
        + ("; ±0: every differing element is a sign flip near zero" if FLIPS_ONLY in marks else ""),
        fontsize=9,
    )
    return fig


def _element_values(t: Tensor, ref: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-element ULP distance and sign flips, 2-D. Bits that differ at 0 ULP count 1, NaN mismatches
    the top bin; an element whose value crossed zero (h3lab.metrics.drift_stats) is a sign flip, drawn
    in SIGN_FLIP over its cell, and counts 1 in the ULP map."""
    a, b = t.detach().cpu(), ref.detach().cpu()
    ulp = ulp_map(a, b).to(torch.float64)
    ulp = torch.where(ulp == NAN_MISMATCH, float(ULP_EDGES[-2]), ulp)
    differs = bit_pattern(a) != bit_pattern(b)
    flips = sign_flips(a, b, differs)
    ulp = torch.where(differs & ~flips, ulp.clamp(min=1), torch.where(flips, 1.0, 0.0))
    shape = (ulp.shape[0], -1) if ulp.dim() >= 2 else (1, -1)
    return ulp.reshape(shape).numpy(), flips.reshape(shape).numpy().astype(np.float64)


def block_max(values: np.ndarray, max_cells: int = MAX_CELLS) -> tuple[np.ndarray, tuple[int, int]]:
    """Shrink a 2-D map to at most max_cells per side by the max over blocks (a difference never vanishes)."""
    bh, bw = (-(-n // max_cells) for n in values.shape)
    if (bh, bw) == (1, 1):
        return values, (1, 1)
    h, w = -(-values.shape[0] // bh) * bh, -(-values.shape[1] // bw) * bw
    padded = np.zeros((h, w))
    padded[: values.shape[0], : values.shape[1]] = values
    return padded.reshape(h // bh, bh, w // bw, bw).max(axis=(1, 3)), (bh, bw)


def element_map(
    t: Tensor, ref: Tensor, fp64: Tensor | None = None, *, name: str = "", ref_label: str = "single-process block"
) -> Figure:
    """Per-element ULP map of `t` against `ref` and, given the FP64 oracle, against FP64 rounded to t's dtype.

    Args:
        t: one tensor of a layout's result (rows x channels; 1-D tensors are drawn as one row).
        ref: the same tensor of the reference (same dtype and shape).
        fp64: the FP64 oracle's tensor, or None.
        name: the tensor's name, for titles.
        ref_label: what `ref` is, for the first panel's title.

    Returns:
        The figure: one panel per reference; axes titled "vs <ref_label>" and "vs FP64".
    """
    panels = [(f"vs {ref_label}", *_element_values(t, ref), "")]
    if fp64 is not None:
        e = error_stats(t, fp64)
        note = f"rel L2 {e['rel_l2']:.2e}, max abs {e['max_abs']:.2e}, max {e['max_ulp_vs_rounded_ref']} ULP"
        dtype = str(t.dtype).removeprefix("torch.")
        panels.append((f"vs FP64 rounded to {dtype}", *_element_values(t, fp64.to(t.dtype)), note))
    fig = Figure(figsize=(5.2 * len(panels) + 1.2, 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    dims = ("row", "channel") if name in ("out", "dx") else ("dim 0", "dim 1")
    flip_cmap = ListedColormap([SIGN_FLIP])
    for ax, (label, values, flips, note) in zip(axes, panels, strict=True):
        shown, (bh, bw) = block_max(values)
        im = _panel(ax, shown, ULP_EDGES, None)
        flipped, _ = block_max(flips)
        ax.imshow(
            np.ma.masked_equal(flipped, 0), cmap=flip_cmap, vmin=0, vmax=1, interpolation="nearest", aspect="auto"
        )
        block = f" (each cell: max over {bh}x{bw})" if (bh, bw) != (1, 1) else ""
        n = int(flips.sum())
        note = "; ".join(x for x in (note, f"{n} sign flips near zero (blue)" if n else "") if x)
        ax.set_title(f"{name} {label}{block}\n{note}".strip(), fontsize=8)
        ax.set_xlabel(dims[1], fontsize=8), ax.set_ylabel(dims[0], fontsize=8)
    cb = fig.colorbar(im, ax=axes.tolist(), spacing="uniform", ticks=ULP_EDGES[:-1], shrink=0.95)
    cb.ax.set_yticklabels([_edge_label(e) for e in ULP_EDGES[:-1]], fontsize=6)
    cb.set_label("ULP (grey: bit-identical; blue: sign flip)", fontsize=7)
    return fig


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    """The figure as PNG; no software tag or timestamp, so the same figure gives the same bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def alt_text(fig: Figure) -> str:
    """The figure's titles, one line: the alt text of its image in the published report."""
    titles = [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes if ax.get_title()]
    return "; ".join(t.replace("\n", " ") for t in titles if t)


def show(fig: Figure, path: str | Path | None = None) -> None:
    """Save `fig` as PNG at `path` (if given) and display it inline (in a notebook), as an image."""
    data = png_bytes(fig)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display

        if get_ipython() is not None:
            display(Image(data=data, format="png", metadata={"alt": alt_text(fig)}))
    except ImportError:  # a plain Python caller: the file is the output
        pass


def divergence_timeline(rows: list[dict], title: str = "") -> Figure:
    """Every traced op in execution order: grey when bit-identical, else its max-ULP bin; a line at the first.

    `rows` is `h3lab.run.trace.timeline(...)`; the x axis is the op index, labelled at each block's start.
    """
    cmap, norm = binned_cmap(ULP_EDGES)
    values = np.array([[_ulp_cell(r["bitwise_equal"], r.get("max_ulp", 0)) if r["present"] else np.nan for r in rows]])
    fig = Figure(figsize=(min(14, 2 + 0.08 * len(rows)), 2.2))
    ax = fig.subplots()
    im = ax.imshow(values, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    first = next((r["index"] for r in rows if not r["bitwise_equal"]), None)
    if first is not None:
        ax.axvline(first - 0.5, color="black", linewidth=1.2)
        ax.set_title(f"{title}: first divergence at op {first}, {rows[first]['name']}", fontsize=9)
    else:
        ax.set_title(f"{title}: every op bit-identical", fontsize=9)
    starts = [
        r["index"]
        for r in rows
        if r["block"] is not None and (r["index"] == 0 or rows[r["index"] - 1]["block"] != r["block"])
    ]
    ax.set_xticks(starts, [f"b{rows[i]['block']}" for i in starts], fontsize=7)
    ax.set_yticks([])
    ax.set_xlabel("ops in execution order (forward, then backward)")
    fig.colorbar(im, ax=ax, label="max ULP", pad=0.01)
    return fig
