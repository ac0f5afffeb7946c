"""Layouts as data and SeqShard co-sharding: pure, no processes."""

from __future__ import annotations

import pytest
import torch

from h3lab import H3Config, packed_batch
from h3lab.batch import ROW_FIELDS
from h3lab.parallel.layout import ALL_LAYOUTS, Layout, parse_layouts
from h3lab.parallel.seqshard import SeqShard


def test_the_seven_named_layouts_round_trip():
    layouts = parse_layouts(["all"])
    assert [lay.name for lay in layouts] == list(ALL_LAYOUTS)
    assert [lay.world for lay in layouts] == [1, 2, 4, 8, 8, 8, 8]
    assert [lay.hierarchical for lay in layouts] == [False, False, False, False, True, False, False]
    assert all(Layout.parse(lay.name) == lay for lay in layouts)
    assert parse_layouts("tp2, cp2 tp2+sp tp2") == [Layout(tp=2), Layout(cp=2), Layout(tp=2, sp=True)]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tp3", r"tp=3 not allowed; allowed: \[1, 2, 4, 8\]"),
        ("tp16", r"tp=16 not allowed"),
        ("tp8:3x4", r"cannot split over nodes=3"),
        ("tp8:2x3", r"world size mismatch: 2 nodes x 3 ranks"),
        ("tp1+sp", r"needs tp >= 2"),
        ("pp2", r"unknown layout 'pp2'; allowed: tp1, tp2, tp4, tp8, tp8:2x4, tp4xcp2, tp4xcp2\+sp"),
        ("", r"unknown layout ''"),
    ],
)
def test_bad_layouts_fail_with_the_allowed_values(name, message):
    with pytest.raises(ValueError, match=message):
        Layout.parse(name)


def test_ranks_are_node_major_with_tp_innermost():
    lay = Layout.parse("tp4xcp2")
    assert lay.tp_group(1) == [4, 5, 6, 7] and lay.cp_group(2) == [2, 6]
    assert [lay.coords(r) for r in (0, 5, 7)] == [(0, 0), (1, 1), (1, 3)]
    lay = Layout.parse("tp8:2x4")
    assert (
        lay.local == 4 and lay.tp_group(0) == list(range(8)) and [r // lay.local for r in range(8)] == [0] * 4 + [1] * 4
    )
    with pytest.raises(ValueError, match=r"rank 8 out of range \[0, 8\)"):
        lay.coords(8)


@pytest.mark.parametrize("name", (*ALL_LAYOUTS, "cp2", "tp2+sp", "tp2xcp4+sp"))
@pytest.mark.parametrize("rows", [264, 263, 5])
def test_seqshard_covers_every_row_once_and_slices_fields_together(name, rows):
    lay = Layout.parse(name)
    batch = packed_batch(H3Config.tiny(), rows, seed=rows)
    shard = SeqShard(lay, rows)
    assert shard.padded_rows % lay.row_shards == 0 and 0 <= shard.padded_rows - rows < lay.row_shards
    padded = shard.pad(batch)
    assert (padded.logical_keys[rows:, 0] < 0).all() and not padded.active[rows:].any()
    pieces = [shard.coshard(batch, r) for r in shard.owner_ranks()]
    for field in ROW_FIELDS:
        joined = torch.cat([getattr(p, field) for p in pieces])
        assert torch.equal(joined, getattr(padded, field)), field
    for r in range(lay.world):  # every rank's local rows are a slice of its TP rows
        local, tp = shard.local_rows(r), shard.tp_rows(r)
        assert tp.start <= local.start < local.stop <= tp.stop


def test_seqshard_rejects_a_batch_of_another_length():
    shard = SeqShard(Layout.parse("cp2"), 10)
    with pytest.raises(ValueError, match="batch has 11 rows, this SeqShard was made for 10"):
        shard.pad(packed_batch(H3Config.tiny(), 11, seed=0))
