"""Files: what a run reads and writes on disk, and the record of what it ran on.

  checkpoint  synthesize a checkpoint in the diffusers layout; load tensors or one block from one
  manifest    a checkpoint folder's files and the sha256 manifest that pins every file and tensor
  env         the environment record of a run (versions, devices, node type, git state)
  jsonfile    the one JSON writer (atomic: a reader never sees half a record)
  tensorfile  its safetensors twin (atomic; a failed write leaves nothing behind)
  rundir      run folders: one writer each (an exclusive claim), "stale" when the writer is gone

May import: the core (h3lab's flat modules). Imported by everything above it.
"""
