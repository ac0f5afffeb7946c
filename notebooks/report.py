# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% tags=["parameters"]
runs = []  # run directories: sweeps (runs/<id>) or `h3lab run` folders
title = "h3lab: bitwise layout invariance of the MiniMax-H3 block"
element_layout = ""  # the per-element maps' layout; "" takes the sweep's last layout
element_tensor = "out"
fp64 = True  # per-element error against the FP64 oracle (a real block's oracle holds about 10 GB)
out_dir = ""  # where the figures are saved; "" keeps them inline only
benchmarks = {}  # name -> {"path": JSON record, "command": ..., "what": ...} or {"skipped": reason}: the speed tables
note = ""  # markdown shown under the title (where the runs come from, when their records do not say)

# %%
from h3lab.workbench import views
from h3lab.workbench.params import ReportParams
from h3lab.workbench.rundata import load_sweep

p = ReportParams(
    runs=runs,
    title=title,
    element_layout=element_layout,
    element_tensor=element_tensor,
    fp64=fp64,
    out_dir=out_dir,
    benchmarks=benchmarks,
    note=note,
)
sweeps = [load_sweep(r) for r in p.runs]

# %%
views.show_header(sweeps, p.title, p.note)

# %% [markdown]
# Every layout computes one MiniMax-H3 block (forward output, dX, d temb and every weight
# gradient) on several processes launched by torchrun, and every byte is compared with the same
# block computed in one process. In the **deterministic** mode (the `h3-parallel-v1` contract:
# eight reduction units, fixed reduction trees, one rounding per op) every layout must give the
# same bytes. The **baseline** mode runs library kernels and collectives for contrast.
#
# ## Verdicts

# %%
views.show_verdicts(sweeps)

# %% [markdown]
# ## Layout x tensor
# How far each tensor's bits drift from the single-process block, where they drift. Top: the largest
# difference in ULPs of the tensor's typical exponent (the exponent of its RMS); middle: the 99th
# percentile of the ULP distance over the elements that differ; bottom: the fraction of elements
# whose bits differ. Elements near zero whose sign flipped are counted apart: their ULP distance
# counts every float around zero and says nothing about size. Grey cells are bit-identical.

# %%
views.show_heatmaps(sweeps, p.out_dir)

# %% [markdown]
# The maximum ULP distance of every differing tensor, with its sign flips and percentiles:

# %%
views.show_drift(sweeps)

# %% [markdown]
# ## Speed
# Steady-state figures from the benchmarks (warm-up first, then the median of many timed calls),
# each with the machine and the commit it was measured at. The correctness runs above time one step
# each, compilation included, and are not shown as speed.

# %%
views.show_benchmarks(p.benchmarks)

# %% [markdown]
# ## Per element
# One tensor of one layout, element by element: against the single-process block of the same mode,
# and against the FP64 oracle rounded to the tensor's dtype.

# %%
views.show_element_maps(sweeps[0], p.element_layout, p.element_tensor, fp64=p.fp64, out_dir=p.out_dir)

# %% [markdown]
# ## Accuracy against FP64 and diffusers
# Relative L2 error of the canonical bf16 block and of diffusers' bf16 block against the FP64
# oracle; fp32 parity compares the two blocks in float32.

# %%
views.show_accuracy(sweeps)

# %% [markdown]
# ## Environment

# %%
views.show_environment(sweeps)
