"""Each figure is drawn from its data: read the rendered pixels back and check the cells' colours."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm

from h3lab.workbench import figures
from h3lab.workbench.figures import FAILED, FRAC_EDGES, IDENTICAL, RMS_EDGES, SIGN_FLIP, ULP_EDGES, binned_cmap
from h3lab.workbench.tables import _worst_ulp


def _pixels(fig) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())


def _cell_rgba(fig, rgba: np.ndarray, title: str, row: int, col: int) -> np.ndarray:
    """The rendered colour of cell (row, col) of the axes titled `title`, off-centre (labels sit in the centre)."""
    (ax,) = [a for a in fig.axes if a.get_title().startswith(title)]
    x, y = ax.transData.transform((col - 0.3, row - 0.3))
    return rgba[round(float(rgba.shape[0] - y)), round(float(x))]


def _rgba8(color) -> np.ndarray:
    return np.round(np.asarray(color) * 255).astype(np.uint8)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.abs(a.astype(int) - b.astype(int)).max() <= 1)


def _verdicts() -> pd.DataFrame:
    rows = []
    for mode in ("deterministic", "baseline"):
        for layout in ("tp2", "tp4"):
            for tensor in ("out", "dx", "dw.norm1.weight"):
                equal, ulp, p99, rms, frac, status = True, 0, None, 0.0, 0.0, "passed"
                if mode == "baseline" and layout == "tp2":  # out: p99 3 ULP, 0.3 ULP at RMS, max 31k ULP (a flip);
                    status = "mismatch"  # dx +0 vs -0 (0 ULP, bits differ); dW equal
                    equal, ulp, p99, rms, frac = {
                        "out": (False, 31000, 3, 0.3, 0.3),
                        "dx": (False, 0, 0, 0.0, 0.01),
                    }.get(tensor, (True, 0, None, 0.0, 0.0))
                if mode == "baseline" and layout == "tp4":  # a layout that failed: no verdicts
                    equal, ulp, p99, rms, frac, status = None, None, None, None, None, "failed"
                rows.append(
                    {
                        "node_type": "CPU",
                        "run_id": "r",
                        "mode": mode,
                        "seed": 0,
                        "layout": layout,
                        "layout_status": status,
                        "tensor": tensor,
                        "bitwise_equal": equal,
                        "max_ulp": ulp,
                        "ulp_p99": p99,
                        "max_ulp_at_rms": rms,
                        "frac_differing": frac,
                    }
                )
    df = pd.DataFrame(rows)
    df["bitwise_equal"] = df["bitwise_equal"].astype("boolean")
    df["max_ulp"] = df["max_ulp"].astype("Int64")
    df["ulp_p99"] = df["ulp_p99"].astype("Int64")
    df["max_ulp_at_rms"] = df["max_ulp_at_rms"].astype("Float64")
    return df


def test_binned_colormap_reserves_the_first_colour_for_bit_identical():
    cmap, norm = binned_cmap(ULP_EDGES)
    assert isinstance(norm, BoundaryNorm) and list(norm.boundaries[:5]) == [0, 1, 2, 4, 8]
    colours = [tuple(cmap(i)) for i in range(cmap.N)]
    assert colours[0] == IDENTICAL and IDENTICAL not in colours[1:]
    assert norm(0) == 0 and norm(1) == 1 and norm(3) == 2 and norm(2**20) == cmap.N - 1


def test_heatmap_cells_take_the_colour_of_their_bin():
    fig = figures.verdict_heatmap(_verdicts())
    rgba = _pixels(fig)
    ulp_cmap, _ = binned_cmap(ULP_EDGES)
    rms_cmap, rms_norm = binned_cmap(RMS_EDGES)
    frac_cmap, frac_norm = binned_cmap(FRAC_EDGES)
    cell = lambda title, r, c: _cell_rgba(fig, rgba, title, r, c)  # noqa: E731
    panels = ("p99 ULP", "max error, ULPs at RMS", "fraction differing")
    # deterministic: every cell is bit-identical grey, in every panel
    for r in range(2):
        for c in range(3):
            for panel in panels:
                assert _close(cell(f"{panel} | deterministic", r, c), _rgba8(IDENTICAL))
    # baseline tp2 out: p99 3 ULP -> bin [2, 4), not the 31k of its max; 0.3 ULP at RMS -> bin [1/4, 1)
    assert _close(cell("p99 ULP | baseline", 0, 0), _rgba8(ulp_cmap(2)))
    assert _close(cell("max error, ULPs at RMS | baseline", 0, 0), _rgba8(rms_cmap(int(rms_norm(0.3)))))
    # dx differs at 0 ULP (+0 vs -0) -> the first non-grey bin in both; dW equal -> grey
    assert _close(cell("p99 ULP | baseline", 0, 1), _rgba8(ulp_cmap(1)))
    assert _close(cell("max error, ULPs at RMS | baseline", 0, 1), _rgba8(rms_cmap(1)))
    assert _close(cell("p99 ULP | baseline", 0, 2), _rgba8(IDENTICAL))
    assert _close(cell("fraction differing | baseline", 0, 0), _rgba8(frac_cmap(int(frac_norm(0.3)))))
    assert not _close(cell("fraction differing | baseline", 0, 1), _rgba8(IDENTICAL))
    # baseline tp4 failed: the reserved dark colour, not grey
    for panel in panels:
        assert _close(cell(f"{panel} | baseline", 1, 0), _rgba8(FAILED))
    labels = {t.get_text() for ax in fig.axes if ax.get_title().startswith("p99") for t in ax.texts}
    assert labels == {"3", "1"} and "31k" not in {t.get_text() for ax in fig.axes for t in ax.texts}
    # nearest, never a blending filter
    assert all(im.get_interpolation() == "nearest" for ax in fig.axes for im in ax.get_images())


def test_element_map_marks_exactly_the_differing_elements():
    torch.manual_seed(0)
    ref = torch.randn(8, 16).to(torch.bfloat16)
    t = ref.clone()
    bits = t.view(torch.int16)
    bits[2, 5] += 1  # one ULP
    bits[6, 10] += 100  # 100 ULPs: bin [64, 128)
    fig = figures.element_map(t, ref, fp64=t.double(), name="out")
    rgba = _pixels(fig)
    cmap, _ = binned_cmap(ULP_EDGES)
    panel = "out vs single-process block"
    assert _close(_cell_rgba(fig, rgba, panel, 2, 5), _rgba8(cmap(1)))
    assert _close(_cell_rgba(fig, rgba, panel, 6, 10), _rgba8(cmap(7)))
    assert _close(_cell_rgba(fig, rgba, panel, 0, 0), _rgba8(IDENTICAL))
    # t against its own FP64 value rounded back: every element identical
    assert _close(_cell_rgba(fig, rgba, "out vs FP64", 6, 10), _rgba8(IDENTICAL))


def test_element_map_draws_sign_flips_apart_from_the_ulp_scale():
    torch.manual_seed(1)
    ref = torch.randn(8, 16).to(torch.bfloat16)
    t = ref.clone()
    t[3, 4], ref[3, 4] = -0.0, 0.002  # across zero: ~15k ULP, drawn as a flip, not in the top bin
    t.view(torch.int16)[5, 6] += 2  # 2 ULP, same sign (randn is never exactly 0 here)
    fig = figures.element_map(t, ref, name="dx")
    rgba = _pixels(fig)
    cmap, _ = binned_cmap(ULP_EDGES)
    panel = "dx vs single-process block"
    assert _close(_cell_rgba(fig, rgba, panel, 3, 4), _rgba8(SIGN_FLIP))
    assert _close(_cell_rgba(fig, rgba, panel, 5, 6), _rgba8(cmap(2)))
    assert _close(_cell_rgba(fig, rgba, panel, 0, 0), _rgba8(IDENTICAL))
    assert "1 sign flips near zero" in fig.axes[0].get_title()


def test_block_max_keeps_a_single_difference_visible():
    values = np.zeros((2000, 10))
    values[1234, 7] = 5.0
    shown, (bh, bw) = figures.block_max(values, max_cells=512)
    assert shown.shape[0] <= 512 and (bh, bw) == (4, 1)
    assert shown.max() == 5.0 and shown[1234 // 4, 7] == 5.0


def test_heatmap_refuses_empty_data():
    with pytest.raises(ValueError, match="no verdicts"):
        figures.verdict_heatmap(pd.DataFrame(columns=["mode", "layout", "tensor"]))


def test_divergence_timeline_is_drawn_from_the_trace():
    from h3lab.run.trace import timeline

    g = torch.Generator().manual_seed(4)
    names = [f"block{b}.{op}" for b in range(2) for op in ("norm1", "attn.to_q", "ff.net.2")]
    a = {n: torch.randn(8, 16, generator=g).bfloat16() for n in names}
    b = {n: t.clone() for n, t in a.items()}
    flipped = b["block1.attn.to_q"].view(torch.int16)
    flipped.view(-1)[5] ^= 3  # 3 ULP in one element of op 4
    rows = timeline(a, [(n, "local") for n in names], b)
    fig = figures.divergence_timeline(rows, title="tp2")
    rgba = _pixels(fig)
    assert "first divergence at op 4, block1.attn.to_q" in fig.axes[0].get_title()
    for i, row in enumerate(rows):
        cell = _cell_rgba(fig, rgba, "tp2", 0, i)
        if i == 4:  # 3 ULP falls in the [2, 4) bin
            cmap, norm = binned_cmap(ULP_EDGES)
            assert _close(cell, _rgba8(cmap(norm(3))))
        else:
            assert row["bitwise_equal"] and _close(cell, _rgba8(IDENTICAL)), i


def test_digest_only_verdicts_are_drawn_equal_or_differing_without_counts():
    """`h3lab run --digests` verdicts carry no ULP or fraction: equal is grey, differing the first bin."""
    rows = [
        {
            "node_type": "H200",
            "run_id": "r",
            "mode": "deterministic",
            "seed": 0,
            "layout": "tp2",
            "layout_status": "mismatch",
            "tensor": t,
            "bitwise_equal": eq,
            "max_ulp": None,
            "frac_differing": None,
        }
        for t, eq in (("dw.attn.to_q.weight.u0", True), ("dw.attn.to_q.weight.u1", False))
    ]
    df = pd.DataFrame(rows).astype({"bitwise_equal": "boolean", "max_ulp": "Int64"})
    fig = figures.verdict_heatmap(df)
    rgba = _pixels(fig)
    ulp_cmap, _ = binned_cmap(ULP_EDGES)
    rms_cmap, _ = binned_cmap(RMS_EDGES)
    assert _close(_cell_rgba(fig, rgba, "p99 ULP | deterministic", 0, 0), _rgba8(IDENTICAL))
    assert _close(_cell_rgba(fig, rgba, "p99 ULP | deterministic", 0, 1), _rgba8(ulp_cmap(1)))
    assert _close(_cell_rgba(fig, rgba, "max error, ULPs at RMS | deterministic", 0, 1), _rgba8(rms_cmap(1)))
    assert _close(_cell_rgba(fig, rgba, "fraction differing | deterministic", 0, 0), _rgba8(IDENTICAL))
    frac_cmap, _ = binned_cmap(FRAC_EDGES)  # differing, fraction unknown: the first bin, not "no result"
    assert _close(_cell_rgba(fig, rgba, "fraction differing | deterministic", 0, 1), _rgba8(frac_cmap(1)))
    labels = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert labels == ["≠", "≠", "≠"], labels  # the differing cell in every panel; the equal one unlabelled
    assert "size not recorded (digests)" in fig._suptitle.get_text()
    equal = {"bitwise_equal": True, "max_ulp": 0}
    assert _worst_ulp({"out": equal, "dw.u1": {"bitwise_equal": False}}) is None  # unknown, not 0
    assert _worst_ulp({"out": {"bitwise_equal": False, "max_ulp": 3}, "dw.u1": {"bitwise_equal": True}}) == 3


def test_verdict_table_headlines_the_percentile_and_the_drift_table_keeps_the_maximum():
    from h3lab.workbench.tables import drift_table, verdict_table

    base = {"seed": 0, "tensors": 15, "failed_rank": pd.NA}
    layouts = pd.DataFrame(
        [
            base | {"layout": "tp2", "mode": "deterministic", "status": "passed", "tensors_equal": 15},
            base
            | {"layout": "tp2", "mode": "baseline", "status": "mismatch", "tensors_equal": 0, "max_ulp": 2046798712}
            | {"ulp_p99": 3, "max_ulp_at_rms": 12.4, "max_err_of_rms": 0.0213, "sign_flips": 2},
            base | {"layout": "tp8", "mode": "baseline", "status": "mismatch", "tensors_equal": 14, "max_ulp": pd.NA},
        ]
    )
    table = verdict_table(layouts)
    assert table.loc["tp2", "deterministic"] == "passed 15/15"
    assert table.loc["tp2", "baseline"] == "mismatch: 15 of 15 differ, max |a-b| 2.1e-02 of RMS, 2 sign flips"
    assert table.loc["tp8", "baseline"] == "mismatch: 1 of 15 differ (by digest)"
    block = _verdicts().assign(problem="block 0")
    chain = _verdicts().assign(problem="blocks 0-3")
    chain.loc[chain["tensor"].eq("out"), "max_ulp"] = 5  # another problem's out: kept apart, not maxed in
    drift = drift_table(pd.concat([block, chain], ignore_index=True))
    out, dx = ("CPU", "block 0", "baseline", "tp2", "out"), ("CPU", "block 0", "baseline", "tp2", "dx")
    assert list(drift.index)[:2] == [out, dx] and len(drift) == 4
    assert drift.loc[out, "max ULP"] == 31000  # the maximum, one table away
    assert drift.loc[out, "p99 ULP"] == 3
    assert drift.loc[("CPU", "blocks 0-3", "baseline", "tp2", "out"), "max ULP"] == 5


def test_a_summary_kept_without_its_files_still_gives_every_verdict(tmp_path):
    """A digests run's summary alone (its canonical.digests.json not kept): every tensor it judged is drawn."""
    from h3lab.workbench.rundata import load_sweep
    from h3lab.workbench.tables import verdict_frame

    equal = {"bitwise_equal": True}
    summary = {
        "status": "passed",
        "request": {"problem": {"mode": "deterministic", "seed": 0, "block": 0, "rows": 264, "synthetic": "real"}},
        "canonical": {"sha256": {"out": "a", "dx": "b"}},
        "layouts": {"tp2": {"status": "passed", "tensors": {"out": equal, "dx": equal, "dw.x@u0": equal}}},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    frame = verdict_frame([load_sweep(tmp_path)])
    assert list(frame["tensor"]) == ["out", "dx", "dw.x@u0"]
    assert set(frame["problem"]) == {"block 0, 264 rows, synthetic real"}


def test_a_tensor_whose_differences_are_all_sign_flips_is_marked_not_drawn_as_one_ulp():
    """Its p99 over the non-flip differing elements has no elements: the cell says ±0 (the title says
    what that means), while the max-error and fraction panels keep their values."""
    row = {
        "node_type": "CPU",
        "run_id": "r",
        "mode": "deterministic",
        "seed": 0,
        "layout": "tp2",
        "layout_status": "mismatch",
        "bitwise_equal": False,
        "max_ulp": 2046798712,  # -tiny vs +tiny: counted across every float around zero
        "ulp_p99": None,
        "sign_flips": 3,
        "max_ulp_at_rms": 0.25,
        "frac_differing": 0.003,
    }
    df = pd.DataFrame([row | {"tensor": "dtemb"}, row | {"tensor": "out", "ulp_p99": 5, "sign_flips": 0}])
    df = df.astype({"bitwise_equal": "boolean", "max_ulp": "Int64", "ulp_p99": "Int64", "sign_flips": "Int64"})
    fig = figures.verdict_heatmap(df)
    texts = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes if ax.get_title()}
    assert texts["p99 ULP | deterministic"] == ["±0", "5"], texts
    assert texts["max error, ULPs at RMS | deterministic"] == ["<1", "<1"], texts
    assert texts["fraction differing | deterministic"] == ["<1%", "<1%"], texts
    assert "±0: every differing element is a sign flip near zero" in fig._suptitle.get_text()
    assert "digests" not in fig._suptitle.get_text()
