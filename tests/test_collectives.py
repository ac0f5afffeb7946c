"""Deterministic collectives: bit-for-bit the local balanced tree on real processes, byte counts, records.

Four launches (P = 2, 3, 4, 8; P=8 as two torchrun agents of 4, emulating two nodes) run every
algorithm, the hierarchical 2x2, 2x4 and 4x2 splits, and subgroups in non-sorted member order;
each rank checks itself against its own local tree and writes verdicts, decisions and bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from h3lab.bench.workers.collective_check import CHECK_SEGMENT_BYTES
from h3lab.contract import TREE_SHAPE
from h3lab.launch.launcher import launch
from h3lab.ops.fixed import balanced_tree
from h3lab.parallel.algorithms import (
    ALGORITHMS,
    AUTO_SCATTER_MIN_BYTES,
    CollectiveDecision,
    choose_algorithm,
    hierarchical_local_sizes,
    hierarchical_tree_string,
    tree_string,
)
from h3lab.parallel.collective_groups import new_collective

SHAPES = "1,7,9973,65537,33x17,3x5"
# world -> (nproc_per_node, agents, worker args): every algorithm on all ranks, plus these extras
LAUNCHES = {
    2: (2, 1, ["--subgroups", "1"]),  # a one-member collective: the identity
    3: (3, 1, ["--local-sizes", "3,1", "--subgroups", "2,0"]),
    4: (4, 1, ["--local-sizes", "2"]),
    8: (4, 2, ["--local-sizes", "4,2", "--subgroups", "7,2,5"]),
}
ITEM = 4  # float32 partials


# ---- in-process: trees, choices, records, argument checks (no launch) ------------------------------


class _Sym:
    """A symbolic operand: `+` records the expression, so balanced_tree's own order can be read back."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __add__(self, other: _Sym) -> _Sym:
        return _Sym(f"({self.text}+{other.text})")


@pytest.mark.parametrize("P", [1, 2, 3, 5, 6, 8])
def test_tree_string_is_balanced_trees_order(P):
    labels = [f"r{i}" for i in range(P)]
    evaluated = balanced_tree([_Sym(s) for s in labels]).text
    expected = f"({tree_string(labels)})" if P > 1 else tree_string(labels)
    assert evaluated == expected


def test_tree_strings_match_the_contract():
    labels = [f"r{i}" for i in range(8)]
    assert tree_string(labels) == TREE_SHAPE.replace("u", "r") == "((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7))"
    assert tree_string(labels[:3]) == "(r0+r1)+r2"
    for L in (1, 2, 4, 8):  # 8x1, 4x2, 2x4, 1x8 all give the flat tree
        assert hierarchical_tree_string(labels, L) == tree_string(labels)
    assert hierarchical_tree_string(labels[:4], 2) == "(r0+r1)+(r2+r3)"
    assert hierarchical_local_sizes(8) == [1, 2, 4, 8]
    assert hierarchical_local_sizes(6) == [1, 3, 6]  # 3 groups of 2 would split the tree differently
    assert hierarchical_local_sizes(3) == [1, 3]


def test_choose_algorithm_auto_rules():
    small, big = AUTO_SCATTER_MIN_BYTES["gloo"] - 4, AUTO_SCATTER_MIN_BYTES["gloo"]
    kw = {"num_members": 8, "local_size": None, "transport": "gloo"}
    assert choose_algorithm("all_reduce", "auto", nbytes=small, **kw)[0] == "gather_tree"
    assert choose_algorithm("all_reduce", "auto", nbytes=big, **kw)[0] == "scatter_tree"
    assert choose_algorithm("reduce_scatter", "auto", nbytes=small, **kw)[0] == "scatter_tree"
    assert choose_algorithm("all_reduce", "auto", nbytes=big, num_members=2, local_size=None, transport="gloo")[0] == (
        "gather_tree"
    )
    alg, reason = choose_algorithm("all_reduce", "auto", nbytes=small, num_members=8, local_size=4, transport="gloo")
    assert alg == "hierarchical" and "local_size 4" in reason
    assert choose_algorithm("all_reduce", "scatter_tree", nbytes=4, **kw) == (
        "scatter_tree",
        "requested 'scatter_tree'",
    )
    assert choose_algorithm("all_gather", "auto", nbytes=4, **kw)[0] == "copy"
    assert choose_algorithm("all_reduce", "auto", nbytes=4, num_members=1, local_size=None, transport="none")[0] == (
        "identity"
    )


def test_decision_record_is_frozen_and_serialisable():
    d = CollectiveDecision(
        site="attn.to_out",
        op="all_reduce",
        algorithm="gather_tree",
        reason="requested",
        tree="r0+r1",
        group={"ranks": [0, 1], "groups": [[0, 1]], "local_size": None},
        dtype="torch.float32",
        numel=10,
        bytes_sent=40,
        bytes_received=40,
        transport="gloo",
    )
    row = d.to_dict()
    assert json.loads(json.dumps(row)) == row and row["bytes_local"] == 0
    with pytest.raises(AttributeError):
        d.algorithm = "scatter_tree"


def test_new_collective_rejects_bad_arguments():
    allowed = r"allowed: \['auto', 'gather_tree', 'scatter_tree', 'hierarchical'\]"
    with pytest.raises(ValueError, match=rf"algorithm 'ring' not allowed; {allowed}"):
        new_collective([0, 1], algorithm="ring")
    assert ALGORITHMS == ("auto", "gather_tree", "scatter_tree", "hierarchical")
    with pytest.raises(ValueError, match=r"local_size 3 does not split 8 members .*allowed: \[1, 2, 4, 8\]"):
        new_collective(list(range(8)), local_size=3)
    with pytest.raises(ValueError, match=r"local_size 0 does not split"):
        new_collective(list(range(8)), local_size=0)
    with pytest.raises(ValueError, match=r"local_size 2 with 6 members: .*allowed: \[1, 3, 6\]"):
        new_collective(list(range(6)), algorithm="hierarchical", local_size=2)
    with pytest.raises(ValueError, match=r"'hierarchical' needs local_size"):
        new_collective([0, 1], algorithm="hierarchical")
    with pytest.raises(ValueError, match=r"ranks \[0, 0\]: need at least one rank, each once"):
        new_collective([0, 0])
    with pytest.raises(ValueError, match=r"needs torch.distributed initialised"):
        new_collective([0, 1])


# ---- launched: P = 2, 3, 4, 8 --------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    """One launch per world size (all of them, once per module): world -> rank records."""
    out = {}
    for world, (nproc, agents, extra) in LAUNCHES.items():
        run_dir = tmp_path_factory.mktemp(f"collectives_p{world}")
        res = launch(
            "h3lab.bench.workers.collective_check",
            [str(run_dir), "--shapes", SHAPES, "--seed", str(world), *extra],
            nproc_per_node=nproc,
            agents=agents,
            log_dir=run_dir / "logs",
            timeout_s=120,
        )
        logs = "\n".join(p.read_text()[-3000:] for p in res.agent_logs)
        assert res.ok, f"P={world} launch failed ({res.returncode}, {res.elapsed_s:.1f} s):\n{logs}"
        out[world] = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return out


def _configs(world: int) -> list[str]:
    _, _, extra = LAUNCHES[world]
    opts = dict(zip(extra[::2], extra[1::2], strict=True))
    configs = [f"all:{a}" for a in ("gather_tree", "scatter_tree", "auto")]
    configs += [f"all:hierarchical:{L}" for L in opts.get("--local-sizes", "").split(",") if L]
    configs += [
        f"{s}:{a}" for s in opts.get("--subgroups", "").split(";") if s for a in ("gather_tree", "scatter_tree")
    ]
    return configs


def _ranks(config: str, world: int) -> list[int]:
    head = config.split(":")[0]
    return list(range(world)) if head == "all" else [int(r) for r in head.split(",")]


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_every_verdict_is_bitwise(runs, world):
    n_shapes = len(SHAPES.split(","))
    for rec in runs[world]:
        mine = [c for c in _configs(world) if rec["rank"] in _ranks(c, world)]
        assert sorted({r["config"] for r in rec["results"]}) == sorted(mine)
        assert len(rec["results"]) == n_shapes * len(mine)
        for row in rec["results"]:
            failed = [k for k, ok in row["verdicts"].items() if not ok]
            assert not failed, (world, rec["rank"], row["config"], row["shape"], failed)
            segmented = 4 if row["algorithm"] == "scatter_tree" else 0  # the pipelined all_reduce, per rep
            assert len(row["verdicts"]) == 18 + segmented + (3 if len(row["shape"]) == 2 else 2)
            if row["P"] >= 3 and row["numel"] >= 9973:  # the data can tell a wrong order from the right one
                assert row["order_sensitive"], (row["config"], row["shape"])


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_misuse_raises_on_every_member(runs, world):
    for rec in runs[world]:
        for config in _configs(world):
            err = rec["errors"]
            if rec["rank"] not in _ranks(config, world):
                assert f"rank {rec['rank']} is not a member" in err[f"{config}/non_member"]
                continue
            assert "is closed" in err[f"{config}/closed"]
            if len(_ranks(config, world)) == 1:
                continue
            assert "members disagree on (dtype, shape)" in err[f"{config}/shape_mismatch"]
            assert "members disagree on dtype or other dims" in err[f"{config}/gather_mismatch"]


def _expected_bytes(row: dict, P: int, member: int, L: int | None) -> tuple[int, int, int] | None:
    """(sent, received, local) bytes per member for one decision record's first call."""
    shape, alg, op = row["site"].split("/")[1], row["algorithm"], row["op"]
    if row["site"].split("/")[2] not in ("all_reduce", "reduce_scatter", "start_all_reduce", "start_reduce_scatter"):
        return None
    dims = [int(d) for d in shape.strip("()").split(",") if d.strip()]
    N = math.prod(dims)
    S = N * ITEM
    rows_me = dims[0] // P + (member < dims[0] % P)
    chunk = rows_me * (N // dims[0]) * ITEM  # this member's reduce_scatter chunk
    if alg == "identity":
        return 0, 0, 0
    if op == "all_reduce":
        if alg == "gather_tree":
            return (P - 1) * S, (P - 1) * S, 0
        if alg == "scatter_tree":
            c = -(-N // P) * ITEM
            return 2 * (P - 1) * c, 2 * (P - 1) * c, 0
        G = P // L
        return (G - 1) * S, (G - 1) * S, (L - 1) * S
    if op == "reduce_scatter":
        if alg == "gather_tree":
            return (P - 1) * S, (P - 1) * S, 0
        if alg == "scatter_tree":
            return S - chunk, (P - 1) * chunk, 0
        G = P // L
        return None, (G - 1) * chunk, (L - 1) * S  # sent: the lane's chunks, uneven
    return None


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_bytes_and_decisions(runs, world):
    for rec in runs[world]:
        for config, block in rec["decisions"].items():
            ranks = _ranks(config, world)
            P, member = len(ranks), ranks.index(rec["rank"])
            L = int(config.split(":")[2]) if config.count(":") == 2 else None
            for row in block["decisions"]:
                op = row["op"]
                assert row["tree"] == ("copy" if op == "all_gather" else tree_string([f"r{q}" for q in ranks]))
                assert row["group"]["ranks"] == ranks and row["dtype"] == "torch.float32"
                assert row["calls"] == (2 if op != "all_gather" else 1)
                assert row["bytes_received_total"] == row["calls"] * row["bytes_received"]
                if op == "all_gather" and "dim0" in row["site"]:  # padded to the largest member (+P-1 rows)
                    dims = [int(d) for d in row["site"].split("/")[1].strip("()").split(",") if d.strip()]
                    padded = (dims[0] + P - 1) * math.prod(dims[1:]) * ITEM
                    assert row["bytes_received"] == row["bytes_sent"] == (P - 1) * padded
                expected = _expected_bytes(row, P, member, L)
                if expected is None:
                    continue
                sent, received, local = expected
                assert row["bytes_received"] == received, (config, row["site"])
                assert sent is None or row["bytes_sent"] == sent, (config, row["site"])
                if L is not None and L > 1:
                    assert row["bytes_local"] == local and "/dev/shm" in row["transport"], row
                if row["algorithm"] == "scatter_tree" and op == "all_reduce":  # ring volume, up to padding
                    S = row["numel"] * ITEM
                    ring = 2 * (P - 1) * S / P
                    assert ring <= row["bytes_received"] <= ring + 2 * (P - 1) * ITEM
                    assert (row["bytes_received"] == ring) == (row["numel"] % P == 0)
            plain = [r for r in block["decisions"] if "/then_" not in r["site"]]
            algs = {r["algorithm"] for r in plain if r["op"] == "all_reduce"}
            want = config.split(":")[1]
            if P == 1:
                assert algs == {"identity"}
            elif want != "auto":
                assert algs == {want}
            elif P == 2:
                assert algs == {"gather_tree"}
            else:
                sizes = {r["numel"] * ITEM for r in plain if r["op"] == "all_reduce"}
                threshold = AUTO_SCATTER_MIN_BYTES["gloo"]
                assert algs == {"gather_tree" if s < threshold else "scatter_tree" for s in sizes}


def test_a_rounding_finish_shrinks_the_gather_at_p2(runs):
    """auto at P=2 with a finish: gather_tree below the threshold; above it scatter_tree, each owner
    rounds its half to bf16 before the gather: S/2 + S/4 received instead of S."""
    seen = set()
    for rec in runs[2]:
        for row in rec["decisions"]["all:auto"]["decisions"]:
            if not row["site"].endswith("/then_all_reduce"):
                continue
            nbytes = row["numel"] * ITEM
            big = nbytes >= AUTO_SCATTER_MIN_BYTES["gloo"]
            assert row["algorithm"] == ("scatter_tree" if big else "gather_tree"), row
            c = -(-row["numel"] // 2)
            assert row["bytes_received"] == (c * ITEM + c * 2 if big else nbytes), row
            seen.add(big)
    assert seen == {True, False}


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_pipelined_scatter_tree_moves_each_segment_as_a_whole_tensor(runs, world):
    """Segments of CHECK_SEGMENT_BYTES (a multiple of P elements), the last one short and padded:
    each moves scatter_tree's 2(P-1)*ceil(len/P) elements, so the byte count shows the segmentation."""
    seen = 0
    for rec in runs[world]:
        for config, block in rec["decisions"].items():
            P = len(_ranks(config, world))
            for row in block["segmented_decisions"]:
                if not row["site"].endswith("/segmented"):  # then_segmented gathers bf16 chunks
                    continue
                seg = CHECK_SEGMENT_BYTES // ITEM // P * P
                numel = row["numel"]
                if P == 1 or numel < 2 * seg:
                    continue
                lens = [min(seg, numel - lo) for lo in range(0, numel, seg)]
                assert len(lens) >= 3
                assert row["bytes_received"] == sum(2 * (P - 1) * -(-n // P) * ITEM for n in lens), row
                seen += 1
    assert seen > 0


def test_p8_hierarchical_trees_equal_the_contract(runs):
    rec = runs[8][5]
    for config in ("all:hierarchical:4", "all:hierarchical:2"):
        rows = rec["decisions"][config]["decisions"]
        L = int(config.split(":")[2])
        assert {r["tree"] for r in rows if r["op"] == "all_reduce"} == {TREE_SHAPE.replace("u", "r")}
        assert rows[0]["group"]["groups"] == [list(range(g, g + L)) for g in range(0, 8, L)]
        assert rows[0]["transport"] == "intra-group: /dev/shm frames; lanes: gloo"
    odd = rec["decisions"]["7,2,5:gather_tree"]["decisions"][0]
    assert odd["tree"] == "(r7+r2)+r5"  # member order, not rank order: (r2+r5)+r7 would differ


def test_shared_memory_names_are_gone(runs):
    used = 0
    for world, recs in runs.items():
        for rec in recs:
            for config, block in rec["decisions"].items():
                L = int(config.split(":")[2]) if config.count(":") == 2 else 1
                assert (block["shm_token"] is not None) == (L > 1), (world, config)
                assert block["shm_leftovers"] == 0
                used += block["shm_token"] is not None
                if block["shm_token"]:  # and none appeared after the launch ended either
                    assert not list(Path("/dev/shm").glob(f"h3lab-{block['shm_token']}-*"))
    assert used == 4 + 3 + 8 + 8  # ranks that made frames: P=4 2x2, P=3 1x3, P=8 2x4 and 4x2
