"""Runs: a problem, computed once in a single process and on every rank of each layout, compared.

  problem   `Problem`: weights, batch and task (block, chain, trajectory, train) of a run, as data;
            `Problem.validate`, the one validator of a run request (the CLI's and the notebooks')
  tasks     what a rank computes for a problem (one code path for the canonical process and ranks)
  trace     op-level traces and the first-divergence finder
  steps     a training run's verdicts and values per step and kind of tensor (summary.json)
  runner    `h3lab run`: the canonical result, each layout on N processes, every byte compared
  progress  a rank's status file: its collective calls counted (DistComm's on_call hook)
  diagnose  which rank (or agent) a failed launch is blamed on, from the files it left
  summary   a run's summary as text (verdict lines, failure lines)
  golden    the published digests of reference problems, one set per backend and GPU architecture
            (`h3lab verify`)
  workers/  the modules a run launches: one rank of a layout, the canonical process, the faults
            tests inject

Processes are started and supervised by h3lab.launch; the benchmarks' workers live in
h3lab.bench.workers.

May import: the core, io, model, reference, dist, launch, train.
"""
