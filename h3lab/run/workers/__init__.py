"""The modules torchrun starts, launched only through h3lab.launch.launcher (one module per kind of job).

rank              one rank of a layout: the block (or chain, trajectory) on its rows and units
canonical         the single-process result of a run, in a process of its own (bounded, killable)
agent             torchrun with every TCP store bound to one address; it dies with its runner
collective_check  deterministic collectives against the local tree; their bandwidth
eager_tp          the eager, non-deterministic block (TP, or any layout) timed on every rank
layout_bench      one rank of the layout benchmark: deterministic and eager steps, every collective timed
hello             joins the process group and reports (a launch smoke test)
faults            the faults tests inject (H3LAB_FAULT)
"""
