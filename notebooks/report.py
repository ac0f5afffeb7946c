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

# %%
from h3lab.workbench import views
from h3lab.workbench.params import ReportParams
from h3lab.workbench.rundata import load_sweep

p = ReportParams(
    runs=runs, title=title, element_layout=element_layout, element_tensor=element_tensor, fp64=fp64, out_dir=out_dir
)
sweeps = [load_sweep(r) for r in p.runs]

# %%
views.show_header(sweeps, p.title)

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
# Top: the largest ULP distance in each tensor; bottom: the fraction of its elements whose bits
# differ. Grey cells are bit-identical; bins are powers of two.

# %%
views.show_heatmaps(sweeps, p.out_dir)

# %% [markdown]
# ## Timings
# Forward and backward seconds of one block step on each rank (median over ranks and seeds, spread
# max - min), collective seconds, MiB sent by all ranks, and deterministic time over baseline time.
# MiB sent counts the collectives h3lab's communicator records: all of them in the deterministic
# mode; in the baseline mode the library all-reduces of the TP reductions are timed but not counted.

# %%
views.show_timings(sweeps)

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
