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

# %% [markdown]
# # Reproduce: the layout sweep
#
# Runs one MiniMax-H3 block under every layout (TP 1/2/4/8, TP8 as 2 nodes x 4, TP4 x CP2, with and
# without sequence parallelism), in the deterministic mode and in the baseline mode (library kernels
# and collectives), and compares every byte of `out`, `dX`, `d temb` and every `dW` with the
# single-process block of the same mode. Workers run under torchrun, launched by `h3lab.run.runner`;
# this notebook only calls the library. Everything lands in `runs/<run id>/`. On GPUs a layout runs one
# process per GPU where its ranks per node fit the `gpus` GPUs (NCCL), else its ranks share them (gloo).
# `blocks` makes it a chain of blocks, `trajectory` a denoising trajectory through the whole model,
# `train_steps` training steps of those blocks with everything around them.

# %% tags=["parameters"]
device = "cpu"  # cpu or cuda
layouts = "all"  # layout names (list or comma-separated) or "all" (the seven of h3lab.parallel.layout.ALL_LAYOUTS)
checkpoint = (
    ""  # a diffusers checkpoint folder; "": synthetic weights of `config` (a tiny block is written as a checkpoint)
)
config = "tiny"  # synthetic config when no checkpoint is given: tiny or real
block = 0  # transformer block index
blocks = ""  # "A-B": a chain of blocks A..B instead of the one block
trajectory = 0  # > 0: sampler steps of a denoising trajectory through the model with blocks `blocks`
train_steps = 0  # > 0: training steps of blocks `blocks` with the embedders and heads, compared after each
rows = 264  # packed rows of the batch
gpus = 0  # cuda: the first `gpus` GPUs (0: every GPU torch sees)
digests = False  # compare weight gradients by digests of unit slices instead of storing them (real shapes)
seeds = [0]  # batch seeds; each (mode, seed) is one runner run
modes = ["deterministic", "baseline"]
backend = "torch"  # kernels of the deterministic mode: torch or triton
repeats = 1  # block steps per rank (timing)
timeout = 600.0  # seconds per layout before the runner kills it and names the straggler
accuracy = True  # the canonical-vs-FP64-vs-diffusers table of `h3lab accuracy` (the first block)
trace = False  # record every op: the explore notebook's first-divergence timeline
run_dir = ""  # "" creates runs/<UTC time>-<node type>-<commit>-<hex>

# %%
from h3lab.workbench import sweep as sw
from h3lab.workbench import views
from h3lab.workbench.params import ReproduceParams

p = ReproduceParams(
    device=device,
    layouts=layouts,
    checkpoint=checkpoint,
    config=config,
    block=block,
    blocks=blocks,
    trajectory=trajectory,
    train_steps=train_steps,
    rows=rows,
    gpus=gpus,
    digests=digests,
    seeds=seeds,
    modes=modes,
    backend=backend,
    repeats=repeats,
    timeout=timeout,
    accuracy=accuracy,
    trace=trace,
    run_dir=run_dir,
)

# %% [markdown]
# ## The run directory: environment, checkpoint, parameters

# %%
run_dir = sw.prepare(p)
print(run_dir)

# %% [markdown]
# ## The sweep
# One runner run per mode and batch seed; each prints its verdict table as it finishes.

# %%
result = sw.run_sweep(run_dir)

# %% [markdown]
# ## Accuracy: canonical bf16 against FP64 and diffusers
# The table of the previous `h3lab accuracy`: the relative L2 error of every tensor against the
# FP64 oracle, for the canonical block and for diffusers' own block, and the two in float32.

# %%
if p.accuracy:
    print(sw.accuracy(run_dir)["table"])

# %%
result = sw.finish(run_dir)
views.show_header([result], f"Sweep {result.run_id}: {result.status}")

# %% [markdown]
# ## Verdicts

# %%
views.show_verdicts([result])

# %%
views.show_heatmaps([result], run_dir)

# %% [markdown]
# ## Speed
# The seconds in this run's records are one step of a correctness run, compilation included: they
# say nothing about speed. Steady-state timings come from the benchmarks (`h3lab publish` runs them
# and renders them into the report of the node type).
