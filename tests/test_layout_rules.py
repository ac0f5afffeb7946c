"""The layout rules' one home, on every layout of `all` (and a few more): which ranks form each group
(`Layout.groups()`), who owns each unit and row shard, which copy a replica must equal, the shards
put back into the full tensor (h3lab.parallel.assemble), and the order groups are created in
(h3lab.parallel.procgroups). Pure: no processes; each rule is checked against SeqShard's rows and the
contract's units, computed apart."""

from __future__ import annotations

import re

import pytest
import torch

from h3lab.contract import NUM_UNITS, units_of_rank
from h3lab.parallel.assemble import (
    full_tensor,
    full_tensors,
    replica_source,
    replicas_agree,
    row_shard,
    unit_owners,
    units_of,
)
from h3lab.parallel.layout import ALL_LAYOUTS, GROUP_KINDS, Layout
from h3lab.parallel.procgroups import new_groups
from h3lab.parallel.seqshard import SeqShard

NAMES = (*ALL_LAYOUTS, "cp2", "tp2+sp", "tp2xcp4+sp", "cp4:2x2")


def _partition(groups: tuple[tuple[int, ...], ...], world: int) -> bool:
    return sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize("name", NAMES)
def test_groups_partition_the_ranks_by_their_coordinates(name):
    lay = Layout.parse(name)
    g = lay.groups()
    assert all(_partition(kind, lay.world) for kind in (g.tp, g.cp, g.rows, g.nodes))
    for c, tp in enumerate(g.tp):  # TP index ascending within one CP group
        assert [lay.coords(r) for r in tp] == [(c, t) for t in range(lay.tp)]
    for t, cp in enumerate(g.cp):  # CP index ascending at one TP index
        assert [lay.coords(r) for r in cp] == [(c, t) for c in range(lay.cp)]
    for n, node in enumerate(g.nodes):
        assert len(node) == lay.local and all(r // lay.local == n for r in node)
    for r in range(lay.world):
        assert all(r in g.of(kind, r) for kind in GROUP_KINDS)
    with pytest.raises(ValueError, match=rf"rank {lay.world} out of range \[0, {lay.world}\) of this layout"):
        g.of("tp", lay.world)
    with pytest.raises(ValueError, match=r"group kind 'pp'; allowed: \['tp', 'cp', 'rows', 'nodes'\]"):
        g.of("pp", 0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [264, 5])
def test_each_row_group_holds_every_row_once_in_row_order(name, rows):
    lay = Layout.parse(name)
    shard = SeqShard(lay, rows)
    for group in lay.groups().rows:
        assert len(group) == lay.row_shards
        per = shard.padded_rows // lay.row_shards
        assert [shard.local_rows(r) for r in group] == [slice(k * per, (k + 1) * per) for k in range(lay.row_shards)]
        assert [row_shard(lay, r) for r in group] == list(range(lay.row_shards))
    for r in range(lay.world):  # SP splits the CP group's rows over its TP ranks, in TP order
        c, t = lay.coords(r)
        assert row_shard(lay, r) == (c * lay.tp + t if lay.sp else c)
    assert shard.owner_ranks() == list(lay.groups().rows[0])


@pytest.mark.parametrize("name", NAMES)
def test_the_tp_ranks_of_each_cp_group_hold_every_unit_once(name):
    lay = Layout.parse(name)
    for c in range(lay.cp):
        owners = unit_owners(lay, c)
        assert len(owners) == NUM_UNITS and all(lay.coords(o)[0] == c for o in owners)
        assert all(u in units_of(lay, owners[u]) for u in range(NUM_UNITS))
        assert [u for r in lay.groups().tp[c] for u in units_of(lay, r)] == list(range(NUM_UNITS))
    for r in range(lay.world):
        assert units_of(lay, r) == units_of_rank(lay.coords(r)[1], lay.tp)


@pytest.mark.parametrize("name", NAMES)
def test_a_replica_source_holds_the_same_rows_or_units(name):
    lay = Layout.parse(name)
    shard = SeqShard(lay, 37)
    for r in range(lay.world):
        local = replica_source(lay, r, "local")
        assert local in lay.groups().rows[0] and shard.local_rows(local) == shard.local_rows(r)
        for space in ("unit", "units"):
            src = replica_source(lay, r, space)
            assert src in lay.groups().tp[0] and units_of(lay, src) == units_of(lay, r)
        assert replica_source(lay, r, "tp_units") == r and replica_source(lay, r, "replicated") == 0
    with pytest.raises(ValueError, match=r"space 'rows'; allowed: \['local', 'tp_units', 'units', 'unit'"):
        replica_source(lay, 0, "rows")


def _shards(lay: Layout, rows: int, g: torch.Generator) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per space: a canonical tensor (padded rows where it has rows) and each rank's part, cut with
    SeqShard's rows and the contract's units."""
    shard = SeqShard(lay, rows)
    S, W = shard.padded_rows, 3  # W columns per unit
    local, tp_units = torch.randn(S, 4, generator=g), torch.randn(S, NUM_UNITS * W, generator=g)
    units, replicated = torch.randn(NUM_UNITS, 2, 3, generator=g), torch.randn(5, generator=g)

    def cols(r: int) -> slice:
        u = units_of(lay, r)
        return slice(u.start * W, u.stop * W)

    return {
        "local": (local, [local[shard.local_rows(r)] for r in range(lay.world)]),
        "tp_units": (tp_units, [tp_units[shard.tp_rows(r), cols(r)] for r in range(lay.world)]),
        "units": (units, [units[units_of(lay, r).start : units_of(lay, r).stop] for r in range(lay.world)]),
        "replicated": (replicated, [replicated.clone() for _ in range(lay.world)]),
    }


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [264, 263])
def test_shards_go_back_into_the_full_tensor_byte_for_byte(name, rows):
    lay = Layout.parse(name)
    for space, (canon, parts) in _shards(lay, rows, torch.Generator().manual_seed(rows)).items():
        trim = rows if space in ("local", "tp_units") else None
        assert torch.equal(full_tensor(parts, lay, space, trim), canon[:trim]), space
    too_many = rf"{lay.world + 1} parts for layout {re.escape(lay.name)}; allowed: one per rank"
    with pytest.raises(ValueError, match=too_many):
        full_tensor([*parts, parts[0]], lay, "replicated")
    with pytest.raises(ValueError, match=r"space 'unit'; allowed: \['local', 'tp_units', 'units', 'replicated'\]"):
        full_tensor(parts, lay, "unit")


@pytest.mark.parametrize("name", NAMES)
def test_named_shards_assemble_and_a_differing_replica_is_seen(name):
    lay = Layout.parse(name)
    g = torch.Generator().manual_seed(lay.world)
    shard = SeqShard(lay, 19)
    out, per_unit = torch.randn(shard.padded_rows, 4, generator=g), torch.randn(NUM_UNITS, 6, generator=g)
    dtemb = torch.randn(2, 3, generator=g)
    parts = [
        {"out": out[shard.local_rows(r)], "dtemb": dtemb.clone()}
        | {f"dw.q@u{u}": per_unit[u].clone() for u in units_of(lay, r)}
        for r in range(lay.world)
    ]

    def space_of(k: str) -> str:
        return "local" if k == "out" else "unit" if "@u" in k else "replicated"

    full = full_tensors(parts, lay, space_of, 19)
    assert sorted(full) == sorted(["out", "dtemb", *(f"dw.q@u{u}" for u in range(NUM_UNITS))])
    assert torch.equal(full["out"], out[:19]) and torch.equal(full["dtemb"], dtemb)
    assert all(torch.equal(full[f"dw.q@u{u}"], per_unit[u]) for u in range(NUM_UNITS))
    assert replicas_agree(parts, lay, space_of)
    for r in range(1, lay.world):  # one bit of one replica (a rank's copy of what rank 0 holds too)
        flipped = [dict(p) for p in parts]
        flipped[r]["dtemb"] = dtemb.clone()
        flipped[r]["dtemb"].view(torch.int32)[0, 0] ^= 1
        assert not replicas_agree(flipped, lay, space_of)


class _Maker:
    """Records each group it is asked to create, as every rank would (the order must not depend on the rank)."""

    def __init__(self, kind: str, log: list) -> None:
        self.kind, self.log = kind, log

    def __call__(self, ranks: list[int]) -> str:
        self.log.append((self.kind, tuple(ranks)))
        return f"{self.kind}{tuple(ranks)}"


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_creates_every_group_once_in_one_order(name):
    lay = Layout.parse(name)
    logs = []
    for rank in range(lay.world + 1):  # one rank outside the layout, as a larger launch has
        log: list = []
        got = new_groups(lay, {k: _Maker(k, log) for k in ("tp", "cp", "rows")}, rank=rank)
        logs.append(log)
        if rank == lay.world:
            assert dict(got.made) == {} and dict(got.members) == {}
            continue
        g = lay.groups()
        assert got.members == {kind: g.of(kind, rank) for kind in ("tp", "cp", "rows")}
        for kind, ranks in got.members.items():
            made = got.made[kind]
            assert (made is None) == (len(ranks) == 1)
            assert made is None or made.endswith(str(ranks))  # an earlier kind's group of the same ranks
    assert all(log == logs[0] for log in logs)
    created = [ranks for _, ranks in logs[0]]
    assert len(created) == len(set(created)) and all(len(r) > 1 for r in created)
    g = lay.groups()
    expected = dict.fromkeys(r for kind in (g.tp, g.cp, g.rows) for r in kind if len(r) > 1)
    assert created == list(expected)


def test_an_unknown_group_kind_is_refused():
    with pytest.raises(ValueError, match=r"group kinds \['pp'\]; allowed: \['tp', 'cp', 'rows', 'nodes'\]"):
        new_groups(Layout.parse("tp2"), {"pp": list}, rank=0)
