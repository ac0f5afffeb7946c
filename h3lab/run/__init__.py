"""Runs: a problem, computed once in a single process and on every rank of each layout, compared.

  problem   `Problem`: weights, batch and task (block, chain, trajectory, train) of a run, as data
  tasks     what a rank computes for a problem (one code path for the canonical process and ranks)
  trace     op-level traces and the first-divergence finder
  steps     a training run's verdicts and values per step and kind of tensor (summary.json)
  launch    the one launch path: torchrun as a subprocess, process groups killed on every exit
  lifeline  launched processes exit when their launcher is gone (parent-death signal, watchdog)
  runner    `h3lab run`: the canonical result, each layout on N processes, every byte compared
  diagnose  which rank (or agent) a failed launch is blamed on, from the files it left
  summary   a run's summary as text (verdict lines, failure lines)
  golden    the published digests of reference problems, one set per backend and GPU architecture
            (`h3lab verify`)
  eager_layouts    the eager baseline at a layout: groups, shards, rows
  layout_diagnose  the layout benchmark's suspects of rank arrival skew, run on a rank's steps
  workers/  the modules launched (one rank of a layout, the canonical process, the agent, collective
            checks, eager layouts, benchmark)

May import: the core, io, model, reference, dist, train.
"""
