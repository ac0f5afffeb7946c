"""The modules a run starts, launched only through h3lab.launch.launcher (one module per kind of job).

rank              one rank of a layout: the block (or chain, trajectory, training steps) on its rows and units
canonical         the single-process result of a run, in a process of its own (bounded, killable)
faults            the faults tests inject (H3LAB_FAULT)
"""
