"""The workbench: notebooks as the front door to the layout runner.

notebooks/{reproduce,explore,report}.py are jupytext py:percent sources; every computation in them
is a call into this package:
  params     the notebooks' parameters, validated in their first cell (ValueError naming the allowed set)
  sweep      a run directory runs/<id>/: env.json, the checkpoint, one runner run per mode and seed
  rundata    reading run directories back: summaries, tensors, the FP64 oracle of a run's problem
  tables     pandas frames of verdicts, per-rank timings and collectives; parquet; timing tables
  figures    the layout x tensor heatmaps and per-element ULP maps (discrete power-of-two bins)
  views      what a notebook cell displays: headings, styled tables and figures per node type
  notebooks  jupytext -> ipynb, papermill execution into a run directory, the parent's progress bar
  publish    executed report notebook -> self-contained HTML under reports/<node type>/, the index
"""
