"""The workbench: notebooks as the front door to the layout runner.

notebooks/{reproduce,explore,report}.py are jupytext py:percent sources; every computation in them
is a call into this package:
  params     the notebooks' parameters, validated in their first cell (ValueError naming the allowed set)
  sweep      a run directory runs/<id>/: env.json, the checkpoint, one runner run per mode and seed
  rundata    reading run directories back: summaries, tensors, the FP64 oracle of a run's problem
  tables     pandas frames of verdicts, per-rank records and collectives; parquet; the terminal summary
  figures    the layout x tensor heatmaps and per-element ULP maps (discrete power-of-two bins)
  benchmarks benchmark records as the report's speed tables, with the machine and commit of each
  views      what a notebook cell displays: headings, styled tables and figures per node type and problem
  notebooks  jupytext -> ipynb, papermill execution into a run directory, the parent's progress bar
  publish    executed report notebook -> self-contained HTML under reports/<node type>[x<GPUs>]/, the index
  plans      what `h3lab publish` sweeps per node kind (the reproduce notebook's parameters)
  stages     resumable stages in one work folder, commands that never outlive their stage
  folder     a published folder as a product: built beside the old one, swapped in, its README
"""
