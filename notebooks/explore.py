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
# # Explore one layout
#
# Per tensor and per element: where does this layout's result differ from the single-process block
# of the same mode, how far is each from the FP64 oracle, and which collective did what. Give
# `run_dir` (a sweep `runs/<id>` or an `h3lab run` folder), or leave it empty to run the layout now.

# %% tags=["parameters"]
run_dir = ""  # a run directory; "" runs `layout` now (config, rows, device, timeout below)
layout = "tp4xcp2+sp"
mode = ""  # deterministic or baseline; "": baseline when the run has it, else the run's mode
seed = 0  # batch seed
tensor = "out"  # out, dx, dtemb or dw.<parameter>
config = "tiny"
rows = 64
device = "cpu"
timeout = 600.0
trace = True  # a fresh run records every op (the first-divergence timeline)
record = ""  # a new file for the key numbers (JSON); "": inside a fresh run's folder, none for a given run_dir

# %%
from h3lab.parallel.layout import Layout
from h3lab.run.runner import slug
from h3lab.workbench import figures, tables, views
from h3lab.workbench import sweep as sw
from h3lab.workbench.params import ExploreParams
from h3lab.workbench.rundata import load_sweep, oracle_tensors

p = ExploreParams(
    run_dir=run_dir,
    layout=layout,
    mode=mode,
    seed=seed,
    tensor=tensor,
    config=config,
    rows=rows,
    device=device,
    timeout=timeout,
    trace=trace,
    record=record,
)

# %%
sweep = load_sweep(p.run_dir) if p.run_dir else sw.run_all(p.sweep_params(sw.new_run_dir(p.device)))
run = sweep.run(p.mode, p.seed)
ours, canonical, fp64 = run.tensors(p.layout), run.canonical(), oracle_tensors(run)
print(f"{p.layout}, {p.mode} mode, batch seed {p.seed}: {run.record(p.layout)['status']} ({run.path})")

# %% [markdown]
# ## Per tensor: against the single-process block

# %%
per_tensor = views.tensor_table(run, p.layout)
per_tensor

# %%
verdicts = tables.verdict_frame([sweep])
figures.show(figures.verdict_heatmap(verdicts[verdicts["layout"] == p.layout], title=p.layout))

# %% [markdown]
# ## Per element: one tensor, against the single-process block and against FP64

# %%
figures.show(figures.element_map(ours[p.tensor], canonical[p.tensor], fp64.get(p.tensor), name=p.tensor))

# %% [markdown]
# ## Error against the FP64 oracle, every tensor

# %%
errors = views.fp64_table(ours, canonical, fp64)
errors.style.format("{:.2e}").format("{:d}", subset=["layout max ULP", "single-process max ULP"])

# %% [markdown]
# ## The first divergence, op by op (traced runs)

# %%
first_divergence = views.show_divergence(run, p.layout)

# %% [markdown]
# ## Collective decisions (rank 0)

# %%
decisions = tables.decision_table(run, p.layout)
decisions

# %%
fresh = run.path / "explore" / f"{slug(Layout.parse(p.layout))}.json" if p.run_dir is None else None
if p.record or fresh:  # never into a run given to explore: it is read only
    saved = views.save_record(p.record or fresh, tensors=per_tensor, fp64=errors, decisions=decisions)
    print(f"key numbers: {saved}")
