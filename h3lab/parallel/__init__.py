"""Distribution: how a layout spreads the block over processes, and the bytes they exchange.

  layout       `Layout`, parsed from `tp{T}[xcp{C}][+sp][:{N}x{L}]` or `cp{C}`: validated data;
               `Layout.groups()`: which ranks form each TP, CP, row and node group
  seqshard     `SeqShard`: which rows of the packed sequence each rank holds (with padding)
  assemble     which ranks own each unit and row shard, replicas, and shards back into the full tensor
  procgroups   a layout's groups created in a torch.distributed world (`new_groups`)
  collectives  deterministic reductions over torch.distributed (gather_tree, scatter_tree, hierarchical)
  distcomm     `DistComm`/`BaselineComm`: the block's `BlockComm` seam for one rank of a layout
  timed        when each collective of a step arrived and left, per rank (benchmarks)

May import: the core only. The block never imports this package: a layout is applied from outside,
through `h3lab.comm.BlockComm` and `h3lab.units`.
"""
