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
# # Your own code under every layout
#
# A training script of your own on diffusers' `MiniMaxH3Transformer3DModel`: a tiny model, a loss
# that is not h3lab's, two steps of AdamW with a clip. `h3lab.parallelize` makes the model
# deterministic in place, and `h3lab compare` runs the script once per layout, comparing everything
# it records (`h3lab.record`: the loss, the norm, every gradient and every weight) byte for byte with
# one process. The same from a shell:
# `h3lab compare --layout tp2 tp4xcp2+sp -- python examples/my_train.py --steps 2`.

# %% tags=["parameters"]
layouts = ["tp2", "tp4xcp2+sp"]  # each against one process (tp1)
steps = 2
script = ""  # your training script; "" runs examples/my_train.py
run_dir = ""  # the compare run's folder (new or empty); "" makes runs/<time>-your-code-<hex>
timeout = 600.0  # seconds per launch

# %%
import runpy

import pandas as pd
from IPython.display import Code, display

import h3lab
from h3lab.run.compare import compare_run, format_compare
from h3lab.workbench import compare_view, figures
from h3lab.workbench.params import YourCodeParams

p = YourCodeParams(layouts=layouts, steps=steps, script=script, run_dir=run_dir, timeout=timeout)

# %% [markdown]
# ## The script
# Five lines are h3lab's: `h3lab.parallelize(model, h3lab.current_layout())`, `h3lab.optim.AdamW`,
# `h3lab.optim.clip_grad_norm_`, `h3lab.record` and `h3lab.full_state_dict`. Everything else is
# plain PyTorch on diffusers' model, its forward arguments and its output.

# %%
display(Code(p.script.read_text(), language="python"))

# %% [markdown]
# ## Here, in one process
# The script's own functions, in this kernel: the model made deterministic for tp1, the steps run
# (`h3lab.record` records nothing outside `h3lab compare`).

# %%
if p.script.name == "my_train.py":
    mine = runpy.run_path(str(p.script), run_name="your_code")
    model = h3lab.parallelize(mine["tiny_model"](), "tp1")
    for k, loss, norm in mine["train"](model, p.steps):
        print(f"step {k}: loss {loss:.6f}, gradient norm {norm:.6f}")

# %% [markdown]
# ## Under every layout
# One torchrun per layout, every rank running the script; each layout's records against tp1's.

# %%
summary = compare_run(p.request())
print(format_compare(summary))
print(f"run directory: {p.run_dir}")

# %% [markdown]
# ## Every parameter after every step
# "equal": the layout's weight has the bytes of one process's.

# %%
with pd.option_context("display.max_rows", None, "display.max_colwidth", None):
    display(compare_view.parameter_table(summary, "w"))

# %% [markdown]
# ## Where bits moved
# Grey cells are bit-identical; a layout that failed is dark.

# %%
figures.show(compare_view.heatmap(summary), p.run_dir / "heatmap.png")
