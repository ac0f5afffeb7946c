"""The pictures: a layout x tensor heatmap of the verdicts, a per-element ULP map of one tensor, and
the op-by-op first-divergence timeline of a traced run.

Both use discrete bins, never a continuous scale: ULP distances fall in power-of-two bins
[0, 1, 2, 4, ..., 2^16, beyond) and fractions of differing elements in [0, <2^-12, 2^-12, ..., 1/2, 1].
The first colour, a neutral grey, is reserved for "bit-identical"; a layout that left no result is
drawn in FAILED. Cells are drawn with imshow(interpolation="nearest"): the default antialiasing
blends neighbouring cells when a map is down-sampled, which would paint identical cells as
different. Figures are matplotlib `Figure` objects (no pyplot state): `show()` saves and displays.
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

from h3lab.metrics import NAN_MISMATCH, bit_pattern, error_stats, ulp_map

IDENTICAL = to_rgba("#d9d9d9")  # neutral grey: bit-identical, and nothing else
FAILED = to_rgba("#3b3b3b")  # no result: the layout failed or the value is missing
ULP_EDGES = np.array([0, 1] + [2**k for k in range(1, 17)] + [2**62], dtype=np.float64)  # last bin: >= 2^16
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


def _digest_only(verdicts: pd.DataFrame) -> pd.Series:
    """Rows whose bits differ but whose verdict is a digest (`h3lab run --digests`): no ULP, no fraction."""
    differs = verdicts["bitwise_equal"].eq(False).fillna(False).astype(bool)
    return differs & verdicts["max_ulp"].isna()


def _labels(values: np.ndarray, unknown: np.ndarray, label) -> list[list[str]]:
    return [
        ["≠" if u == 1 else label(x) for x, u in zip(row, urow, strict=True)]
        for row, urow in zip(values, unknown, strict=True)
    ]


def _short(tensor: str) -> str:
    return ("dW " + tensor[3:].removesuffix(".weight")) if tensor.startswith("dw.") else tensor


def _ulp_label(v: float) -> str:
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


def verdict_heatmap(verdicts: pd.DataFrame, title: str = "") -> Figure:
    """Layout x tensor: max ULP (top row) and fraction of differing elements (bottom), one column per mode.

    Args:
        verdicts: `tables.verdict_frame` rows (several seeds or runs: the worst value per cell).
        title: the figure's title.

    Returns:
        The figure; its axes are titled "max ULP | <mode>" and "fraction differing | <mode>".
    """
    if verdicts.empty:
        raise ValueError("no verdicts to draw; allowed: a non-empty tables.verdict_frame")
    modes = [m for m in ("deterministic", "baseline") if m in set(verdicts["mode"])]
    layouts = list(dict.fromkeys(verdicts["layout"]))
    tensors = list(dict.fromkeys(verdicts["tensor"]))
    # inches: 0.34 per tensor column and 0.3 per layout row keep 6-pt cell labels legible; 2.0 holds the tensor
    # names and titles; a panel gets at least 1.8 so its colorbar's 18 bin labels do not overlap
    fig = Figure(figsize=(2.4 + 0.34 * len(tensors) * len(modes), 2.0 + 2 * max(1.8, 0.5 + 0.3 * len(layouts))))
    fig.set_layout_engine("constrained")
    axes = fig.subplots(2, len(modes), squeeze=False, sharex=True, sharey=True)
    for col, mode in enumerate(modes):
        v = verdicts[verdicts["mode"] == mode]
        eq = v["bitwise_equal"]
        cells = v.assign(
            ulp=[_ulp_cell(e, u) for e, u in zip(eq, v["max_ulp"], strict=True)],
            frac=[_frac_cell(e, f) for e, f in zip(eq, v["frac_differing"], strict=True)],
            unknown=_digest_only(v).astype(float),  # differs, by how much unknown: first bin, labelled "≠"
        )
        ulp, frac, unknown = (
            cells.pivot_table(index="layout", columns="tensor", values=c, aggfunc="max", dropna=False)
            .reindex(index=layouts, columns=tensors)
            .to_numpy(dtype=float)
            for c in ("ulp", "frac", "unknown")
        )
        ulp_text = _labels(ulp, unknown, lambda x: _ulp_label(x) if x > 0 else "")
        frac_text = _labels(frac, unknown, lambda x: "" if not x > 0 else "<1%" if x < 0.01 else f"{100 * x:.0f}%")
        ims = [_panel(axes[0, col], ulp, ULP_EDGES, ulp_text), _panel(axes[1, col], frac, FRAC_EDGES, frac_text)]
        for row, what in enumerate(("max ULP", "fraction differing")):
            ax = axes[row, col]
            ax.set_title(f"{what} | {mode}", fontsize=9)
            ax.set_yticks(range(len(layouts)), layouts, fontsize=8)
        axes[1, col].set_xticks(range(len(tensors)), [_short(t) for t in tensors], rotation=90, fontsize=7)
        if col == len(modes) - 1:
            for row, (edges, label) in enumerate(((ULP_EDGES, "max ULP"), (FRAC_EDGES, "fraction differing"))):
                cb = fig.colorbar(ims[row], ax=axes[row, :].tolist(), spacing="uniform", ticks=edges[:-1], aspect=12)
                cb.ax.set_yticklabels([_edge_label(e) for e in edges[:-1]], fontsize=6)
                cb.set_label(label, fontsize=7)
    fig.suptitle(
        (title or "every layout against the single-process block of the same mode")
        + "\ngrey: bit-identical; dark: no result; numbers: max ULP / % of elements that differ"
        + ("; ≠: digests differ, by how much unknown" if _digest_only(verdicts).any() else ""),
        fontsize=9,
    )
    return fig


def _element_values(t: Tensor, ref: Tensor) -> np.ndarray:
    """Per-element ULP distance, 2-D; bits that differ at 0 ULP count 1, NaN mismatches the top bin."""
    ulp = ulp_map(t, ref).to(torch.float64)
    ulp = torch.where(ulp == NAN_MISMATCH, float(ULP_EDGES[-2]), ulp)
    differs = bit_pattern(t.detach().cpu()) != bit_pattern(ref.detach().cpu())
    ulp = torch.where(differs, ulp.clamp(min=1), 0.0)
    return ulp.reshape(ulp.shape[0], -1).numpy() if ulp.dim() >= 2 else ulp.reshape(1, -1).numpy()


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
    panels = [(f"vs {ref_label}", _element_values(t, ref), "")]
    if fp64 is not None:
        e = error_stats(t, fp64)
        note = f"rel L2 {e['rel_l2']:.2e}, max abs {e['max_abs']:.2e}, max {e['max_ulp_vs_rounded_ref']} ULP"
        dtype = str(t.dtype).removeprefix("torch.")
        panels.append((f"vs FP64 rounded to {dtype}", _element_values(t, fp64.to(t.dtype)), note))
    fig = Figure(figsize=(5.2 * len(panels) + 1.2, 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    dims = ("row", "channel") if name in ("out", "dx") else ("dim 0", "dim 1")
    for ax, (label, values, note) in zip(axes, panels, strict=True):
        shown, (bh, bw) = block_max(values)
        im = _panel(ax, shown, ULP_EDGES, None)
        block = f" (each cell: max over {bh}x{bw})" if (bh, bw) != (1, 1) else ""
        ax.set_title(f"{name} {label}{block}\n{note}".strip(), fontsize=8)
        ax.set_xlabel(dims[1], fontsize=8), ax.set_ylabel(dims[0], fontsize=8)
    cb = fig.colorbar(im, ax=axes.tolist(), spacing="uniform", ticks=ULP_EDGES[:-1], shrink=0.95)
    cb.ax.set_yticklabels([_edge_label(e) for e in ULP_EDGES[:-1]], fontsize=6)
    cb.set_label("ULP (grey: bit-identical)", fontsize=7)
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
    cmap = cmap.copy()
    cmap.set_bad(FAILED)
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
