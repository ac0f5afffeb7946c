"""`Layout`: how one block is spread over processes, as data, parsed from the names users type.

Grammar: `tp{T}` [`xcp{C}`] [`+sp`] [`:{N}x{L}`], or `cp{C}` for TP1 with context parallelism.
Examples: tp1, tp2, tp4, tp8, tp8:2x4 (TP8 as two nodes of four: the hierarchical tree), tp4xcp2,
tp4xcp2+sp, cp2, tp2+sp. Ranks are packed node-major with TP innermost:
rank = cp_index * tp + tp_index, node = rank // local. A TP group that spans nodes (tp > local)
reduces through the hierarchical collective (the tree inside each node, then across nodes).
`Layout.groups()` says which ranks form each TP, CP, row and node group (`Groups`, pure data; the
process groups are created from it by h3lab.parallel.procgroups).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from h3lab.config import NUM_UNITS, H3Config

ALL_LAYOUTS = ("tp1", "tp2", "tp4", "tp8", "tp8:2x4", "tp4xcp2", "tp4xcp2+sp")
TP_SIZES = (1, 2, 4, 8)  # nested subtrees of the 8-unit tree
_NAME = re.compile(r"^(?:tp(?P<tp>\d+)(?:xcp(?P<cp>\d+))?|cp(?P<cp_only>\d+))(?P<sp>\+sp)?(?::(?P<n>\d+)x(?P<l>\d+))?$")
GRAMMAR = "tp{T}[xcp{C}][+sp][:{N}x{L}] or cp{C}[:{N}x{L}], T in 1,2,4,8"


@dataclass(frozen=True)
class Groups:
    """Which ranks form each group of a layout: tuples of global ranks in member order, the order a
    collective over the group reduces and gathers in (TP index, CP index, rank, ascending).

    - `tp[c]`: the TP group of CP group c; its ranks hold contiguous canonical units in unit order.
    - `cp[t]`: the ranks at TP index t of every CP group (each holds its CP group's slice of the rows).
    - `rows`: the groups whose ranks split the sequence's rows among them, each rank a distinct row
      shard in row order: under SP the whole layout (SP splits each TP group's rows again), else
      each `cp[t]`. `rows[0]` holds every row once.
    - `nodes[n]`: the ranks of node n (rank // local).
    A group of one rank is a group too; whoever creates process groups skips those.
    """

    tp: tuple[tuple[int, ...], ...]
    cp: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[int, ...], ...]
    nodes: tuple[tuple[int, ...], ...]

    def of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of `kind` (one of GROUP_KINDS) that holds `rank`."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"group kind {kind!r}; allowed: {list(GROUP_KINDS)}")
        for g in getattr(self, kind):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} out of range [0, {sum(map(len, self.nodes))}) of this layout")


GROUP_KINDS = tuple(f.name for f in fields(Groups))


@dataclass(frozen=True, kw_only=True)
class Layout:
    """tp x cp ranks (sp: sequence parallel inside each TP group) on `nodes` x `local` processes."""

    tp: int = 1
    cp: int = 1
    sp: bool = False
    nodes: int = 1
    local: int = 0  # ranks per node; 0 means world // nodes

    def __post_init__(self) -> None:
        if self.tp not in TP_SIZES:
            raise ValueError(
                f"tp={self.tp} not allowed; allowed: {list(TP_SIZES)} (subtrees of the {NUM_UNITS}-unit tree)"
            )
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"cp={self.cp!r} not allowed; allowed: a positive int")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism splits a TP group's rows; it needs tp >= 2 (e.g. tp2+sp)")
        if self.nodes < 1 or self.world % self.nodes:
            raise ValueError(
                f"{self.world} ranks cannot split over nodes={self.nodes}; allowed: a divisor of {self.world}"
            )
        local = self.local or self.world // self.nodes
        object.__setattr__(self, "local", local)
        if self.nodes * local != self.world:
            raise ValueError(
                f"world size mismatch: {self.nodes} nodes x {local} ranks = {self.nodes * local}, but "
                f"tp x cp = {self.tp} x {self.cp} = {self.world}"
            )
        if self.tp > local and self.tp % local:
            raise ValueError(
                f"a TP group of {self.tp} cannot span nodes of {local} ranks; allowed: a divisor of {self.tp}"
            )
        if self.tp < local and local % self.tp:
            raise ValueError(f"nodes of {local} ranks cannot hold whole TP groups of {self.tp}")

    # ---- names --------------------------------------------------------------------------------
    @classmethod
    def parse(cls, name: str) -> Layout:
        m = _NAME.match(name.strip().lower())
        if not m:
            raise ValueError(f"unknown layout {name!r}; allowed: {', '.join(ALL_LAYOUTS)}, 'all', or {GRAMMAR}")
        tp = int(m["tp"]) if m["tp"] else 1
        cp = int(m["cp"] or m["cp_only"] or 1)
        nodes, local = (int(m["n"]), int(m["l"])) if m["n"] else (1, 0)
        return cls(tp=tp, cp=cp, sp=bool(m["sp"]), nodes=nodes, local=local)

    @property
    def name(self) -> str:
        base = (
            f"tp{self.tp}" + (f"xcp{self.cp}" if self.cp > 1 else "") if self.tp > 1 or self.cp == 1 else f"cp{self.cp}"
        )
        return base + ("+sp" if self.sp else "") + (f":{self.nodes}x{self.local}" if self.nodes > 1 else "")

    def __str__(self) -> str:
        return self.name

    # ---- ranks --------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.tp * self.cp

    @property
    def hierarchical(self) -> bool:
        """The TP group spans nodes: its reductions take the node-local tree, then cross nodes."""
        return self.tp > self.local

    @property
    def row_shards(self) -> int:
        """Row shards of the sequence: CP groups, times the TP ranks under SP."""
        return self.cp * (self.tp if self.sp else 1)

    def coords(self, rank: int) -> tuple[int, int]:
        """(cp_index, tp_index) of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range [0, {self.world}) for layout {self.name}")
        return divmod(rank, self.tp)

    def tp_group(self, cp_index: int) -> list[int]:
        return [cp_index * self.tp + t for t in range(self.tp)]

    def cp_group(self, tp_index: int) -> list[int]:
        return [c * self.tp + tp_index for c in range(self.cp)]

    def groups(self) -> Groups:
        """Every group of this layout (`Groups`): the only place the groups' rules are written."""
        cp = tuple(tuple(self.cp_group(t)) for t in range(self.tp))
        return Groups(
            tp=tuple(tuple(self.tp_group(c)) for c in range(self.cp)),
            cp=cp,
            rows=(tuple(range(self.world)),) if self.sp else cp,
            nodes=tuple(tuple(range(n * self.local, (n + 1) * self.local)) for n in range(self.nodes)),
        )

    def check(self, config: H3Config) -> None:
        """Raise if this layout cannot run `config` (heads and SwiGLU columns must split over tp)."""
        if config.num_attention_heads % self.tp:
            raise ValueError(f"{config.num_attention_heads} heads are not divisible by tp={self.tp} ({self.name})")


def parse_layouts(names: list[str] | tuple[str, ...] | str) -> list[Layout]:
    """Layouts from user names; 'all' expands to the seven named in ALL_LAYOUTS. Duplicates are dropped."""
    if isinstance(names, str):
        names = [n for n in re.split(r"[,\s]+", names) if n]
    if not names:
        raise ValueError(f"no layout given; allowed: {', '.join(ALL_LAYOUTS)}, 'all'")
    out: list[Layout] = []
    for n in names:
        for layout in (Layout.parse(a) for a in (ALL_LAYOUTS if n.strip().lower() == "all" else [n])):
            if layout not in out:
                out.append(layout)
    return out
