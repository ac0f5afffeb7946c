"""Chains of blocks and trajectories under layouts, and the first-divergence finder."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from h3lab import canonical_block, metrics
from h3lab.backend import get_backend
from h3lab.block import block_backward
from h3lab.comm import LocalComm
from h3lab.model.chain import canonical_chain, chain_backward, chain_forward
from h3lab.parallel.layout import parse_layouts
from h3lab.run.problem import Problem
from h3lab.run.runner import RunRequest, run
from h3lab.run.tasks import compute
from h3lab.run.trace import TraceRecorder, first_divergence, load_trace, timeline
from h3lab.units import assemble_unit_grads
from tests.conftest import assert_bitwise

# One layout with every axis (TP, CP, SP) at its smallest: what a chain and a trajectory add to a
# block (each block's input rows carried to the next; a trajectory's steps, each gathering its sequence
# from the row shards) runs on row shards and TP units alike. The TP widths and the two-node split
# (tp8:2x4) are the block's and the comm's (tests/test_runner.py runs the seven layouts), and a 4-block
# chain's forward and backward under tp8:2x4 runs in each training step of tests/test_train_run.py.
LAYOUTS = "tp2xcp2+sp"
CHAIN = Problem(task="chain", block=0, last_block=3, rows=64, seed=21)
BE = get_backend("torch")


def test_a_one_block_chain_is_the_canonical_block():
    p = dataclasses.replace(CHAIN, last_block=0)
    tensors = compute(p, LocalComm(), torch.device("cpu"), backend=BE).tensors
    ref = canonical_block(p.weights(), p.batch())
    assert_bitwise(tensors["out"], ref.out, "out"), assert_bitwise(tensors["dx"], ref.dx, "dx")
    assert_bitwise(tensors["block0.dw.norm1.weight"], ref.dw["norm1.weight"], "dw")
    chain = canonical_chain(p.model_weights(), p.batch(), [0])  # the public entry point, same bits
    assert_bitwise(chain.out, ref.out, "out"), assert_bitwise(chain.blocks[0].dtemb, ref.dtemb, "dtemb")


def test_the_split_chain_is_canonical_blocks_by_hand_from_a_separate_gradient():
    """chain_forward then chain_backward, given an upstream gradient that is not the batch's (a model's
    stack gets it from the head): block 1 forward, then block 1 and block 0 backward, as two canonical
    blocks fed by hand (chain_step is these two calls on a batch carrying the gradient)."""
    p = dataclasses.replace(CHAIN, last_block=1)
    weights, batch = p.model_weights(), p.batch()
    g = torch.randn(batch.hidden_states.shape, generator=torch.Generator().manual_seed(4)).to(batch.grad_out.dtype)
    fwd = chain_forward(weights, batch, LocalComm(), [0, 1], backend=BE)
    assert set(fwd.inputs) == {0, 1} and fwd.blocks == (0, 1)
    split = chain_backward(weights, batch, LocalComm(), fwd, g, backend=BE)
    assert not fwd.inputs  # each block's input rows are taken off as its backward runs
    with pytest.raises(ValueError, match=r"used by a backward already .*; allowed: one backward per chain_forward"):
        chain_backward(weights, batch, LocalComm(), fwd, g, backend=BE)
    b0 = canonical_block(weights.block(0), dataclasses.replace(batch, grad_out=torch.zeros_like(g)))
    b1 = canonical_block(weights.block(1), dataclasses.replace(batch, hidden_states=b0.out, grad_out=g))
    b0 = canonical_block(weights.block(0), dataclasses.replace(batch, grad_out=b1.dx))
    assert_bitwise(split.out, b1.out, "out"), assert_bitwise(split.dx, b0.dx, "dx")
    for i, ref in ((0, b0), (1, b1)):
        assert_bitwise(split.blocks[i].dtemb, ref.dtemb, f"block{i} dtemb")
        dw = assemble_unit_grads(split.blocks[i].dw_units, LocalComm.units) | split.blocks[i].dw_replicated
        for k, t in ref.dw.items():
            assert_bitwise(dw[k], t, f"block{i} dw {k}")


def test_a_chain_that_keeps_its_forwards_gives_the_recomputing_chains_bytes():
    """recompute=False keeps each block's forward records until its backward (h3lab.block.KeptForward):
    every output byte is the recomputing chain's, the trace sees the same ops, and a kept forward
    goes once."""
    p = dataclasses.replace(CHAIN, last_block=2, padding=5)
    weights, batch = p.model_weights(), p.batch()
    traces = {}
    for recompute in (True, False):
        rec = TraceRecorder()
        traces[recompute] = (canonical_chain(weights, batch, [0, 1, 2], trace=rec, recompute=recompute), rec)
    (ref, ref_trace), (kept, kept_trace) = traces[True], traces[False]
    assert_bitwise(kept.out, ref.out, "out"), assert_bitwise(kept.dx, ref.dx, "dx")
    for i in (0, 1, 2):
        assert_bitwise(kept.blocks[i].dtemb, ref.blocks[i].dtemb, f"block{i} dtemb")
        for k, per_unit in ref.blocks[i].dw_units.items():
            for u, t in per_unit.items():
                assert_bitwise(kept.blocks[i].dw_units[k][u], t, f"block{i} {k}@u{u}")
        for k, t in ref.blocks[i].dw_replicated.items():
            assert_bitwise(kept.blocks[i].dw_replicated[k], t, f"block{i} {k}")
    assert kept_trace.order == ref_trace.order  # every op traced once, in the same order
    for name, t in ref_trace.tensors.items():
        assert_bitwise(kept_trace.tensors[name], t, name)
    fwd = chain_forward(weights, batch, LocalComm(), [0], backend=BE, recompute=False)
    kept0 = fwd.kept[0]
    chain_backward(weights, batch, LocalComm(), fwd, batch.grad_out, backend=BE)
    with pytest.raises(ValueError, match=r"kept forward was used by a backward already; allowed: one backward"):
        block_backward(kept0, batch.grad_out)


def test_a_four_block_chain_is_bitwise_under_tp_cp_and_sp_with_every_op_traced(tmp_path):
    summary = run(RunRequest(layouts=tuple(parse_layouts(LAYOUTS)), problem=CHAIN, out=tmp_path / "run", trace=True))
    assert summary["status"] == "passed"
    for rec in summary["layouts"].values():
        names = rec["tensors"].keys()
        assert {"out", "dx", "block0.dtemb", "block3.dw.ff.net.2.weight"} <= names and len(names) == 2 + 4 * 13
        assert all(t["bitwise_equal"] for t in rec["tensors"].values())
        assert rec["first_divergence"] is None  # every op of every block, reassembled, equals the canonical one
    _, order = load_trace(tmp_path / "run" / "layouts" / "tp2xcp2_sp.trace")
    # 16 forward ops per block in block order, then 12 backward ops per block in reverse block order
    assert len(order) == 4 * 28 and order[0][0] == "block0.adaln.table" and order[-1][0] == "block0.dx"


def test_a_two_step_trajectory_is_bitwise_under_tp_cp_and_sp(tmp_path):
    p = Problem(task="trajectory", block=0, last_block=3, steps=2, seed=22)
    summary = run(RunRequest(layouts=tuple(parse_layouts(LAYOUTS)), problem=p, out=tmp_path / "run"))
    assert summary["status"] == "passed"
    for rec in summary["layouts"].values():
        assert set(rec["tensors"]) == {f"step{k}.{m}" for k in range(3) for m in ("video", "audio")}
        assert all(t["bitwise_equal"] for t in rec["tensors"].values())


def _traced(problem: Problem, flip=None) -> tuple[dict, list]:
    rec = TraceRecorder(flip=flip)
    compute(problem, LocalComm(), torch.device("cpu"), backend=BE, trace=rec)
    return rec.tensors, rec.order


def test_the_finder_names_a_planted_single_bit_flip_exactly():
    clean, order = _traced(CHAIN)
    again, _ = _traced(CHAIN)
    assert first_divergence(clean, order, again) is None  # two deterministic runs: no divergence
    flipped, _ = _traced(CHAIN, flip=("block2.ff.net.2", 1000))
    hit = first_divergence(clean, order, flipped)
    assert hit["name"] == "block2.ff.net.2" and hit["block"] == 2 and hit["op"] == "ff.net.2"
    assert hit["num_differing"] == 1 and hit["max_ulp"] == 1  # the lowest mantissa bit of one element
    d = clean["block2.ff.net.2"].shape[1]
    assert hit["first_diff_index"] == [1000 // d, 1000 % d]
    earlier = [r for r in timeline(clean, order, flipped) if r["index"] < hit["index"]]
    assert earlier and all(r["bitwise_equal"] for r in earlier)


def test_the_finder_points_at_the_op_that_diverged_in_baseline_mode(tmp_path):
    p = dataclasses.replace(CHAIN, last_block=1, mode="baseline")
    summary = run(RunRequest(layouts=tuple(parse_layouts("tp2")), problem=p, out=tmp_path / "run", trace=True))
    hit = summary["layouts"]["tp2"]["first_divergence"]
    assert hit is not None and hit["block"] == 0
    canon, order = load_trace(tmp_path / "run" / "canonical.trace")
    layout, _ = load_trace(tmp_path / "run" / "layouts" / "tp2.trace")
    rows = timeline(canon, order, layout)
    assert all(r["bitwise_equal"] for r in rows[: hit["index"]]) and not rows[hit["index"]]["bitwise_equal"]
    # the first op whose bits move under TP2 is a reduction the library orders by shape: a GEMM or all_reduce
    assert hit["op"] in {"attn.to_q", "attn.to_k", "attn.to_v", "attn.sdpa", "attn.to_out.0"}, hit


def test_the_device_checksum_sees_every_single_bit_flip(monkeypatch):
    monkeypatch.setattr(metrics, "_CHUNK", 1000)  # several chunks on a small tensor
    x = torch.randn(37, 101, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = metrics.checksum64(x)
    assert metrics.checksum64(x.clone()) == ref
    bits = x.view(torch.int16).view(-1)
    for index in (0, 999, 1000, 3736):  # chunk edges and the last element
        for bit in (0, 7, 15):
            y = bits.clone()
            y[index] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
            assert metrics.checksum64(y.view(torch.bfloat16).view(37, 101)) != ref, (index, bit)
