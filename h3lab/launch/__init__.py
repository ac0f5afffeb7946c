"""Launch and supervision: processes started, tagged, bounded and swept, whatever ends them.

  launcher  the one launch path: torchrun (or one process) as a subprocess, every process tagged
            with a run token, the process groups killed on every exit
  lifeline  a launched process exits when the processes that launched it are gone
  agent     torchrun with every TCP store bound to one address; it dies with its runner

May import: the core only. What runs inside the processes (a run's ranks, a benchmark's workers)
lives with its concern (h3lab.run.workers, h3lab.bench.workers).
"""
