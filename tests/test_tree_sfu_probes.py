"""The tl.sum tree probe and the special-function probe on a CPU (h3lab.bench.tree_probe, sfu_probe),
with fake GPU units of known rules: the probes read the rules back, the offline checkers rebuild
every saved output, and a wrong reading of the rule shows."""

from __future__ import annotations

import torch

from h3lab.bench import mufu_fit, sfu_probe, sfu_sweeps, tree_probe
from h3lab.emulate import floats, mufu, sfu
from h3lab.emulate import tree as trees
from h3lab.emulate.sfu_ref import exp2_ref
from h3lab.io.jsonfile import write_json


def _layout_tree(n: int) -> trees.Tree:
    lanes = [trees.chain_tree([c for c in range(n) if (c // 2) % 4 == q]) for q in range(4)]
    return ((lanes[0], lanes[2]), (lanes[1], lanes[3]))


def _fake_summer(probe, head_dim, do, x):
    n = x.shape[1]
    tree = _layout_tree(n) if probe == "fwd" else trees.chain_tree(list(range(n)))
    return trees.tree_sum(x.float() * (do.float() if do is not None else 1.0), tree)


def test_tree_probe_reads_the_tree_and_the_checker_agrees(tmp_path):
    record = tree_probe.probe(tmp_path, "cpu", _fake_summer)
    write_json(tmp_path / "summary.json", {"parts": {"tree": record}})
    got = {(r["probe"], r["n"]): r for r in record["records"]}
    assert trees.same_tree(tree_probe._as_tree(got[("fwd", 32)]["tree"]), _layout_tree(32))
    assert trees.same_tree(tree_probe._as_tree(got[("delta", 128)]["tree"]), trees.chain_tree(list(range(128))))
    assert all(r["random_mismatches"] == 0 for r in record["records"])
    rows = tree_probe.check(tmp_path)["rows"]
    assert len(rows) == 4 and all(r["same_tree"] and r["random_mismatches"] == 0 for r in rows)


def _fake_ex2(x, bits=23):
    """A rule to find: 2^floor(x) * 2^frac(x), the fraction rounded to 2^-bits."""
    x64 = torch.where(torch.isfinite(x), x, 0.0).double()
    n = torch.floor(x64)
    q = (torch.round((x64 - n) * 2.0**bits) / 2.0**bits).float()
    y = sfu_sweeps._ftz((exp2_ref(q).double() * sfu_sweeps._pow2(n)).float())
    return torch.where(torch.isfinite(x), y, exp2_ref(x))


def _fake_op(op, x, y=None):
    if op == "ex2":
        return _fake_ex2(x)
    if op == "div":
        return sfu_sweeps.reference("div", x, y)
    return sfu_sweeps.reference(op, x)


def test_sfu_sets_are_rebuilt_from_their_residuals(tmp_path):
    record = sfu_probe.probe(tmp_path, "cpu", _fake_op, grid_bits=10, samples=1 << 10)
    write_json(tmp_path / "summary.json", {"parts": {"sfu": record}})
    assert record["hypotheses"] == {} and record["sets"]["ex2.grid_pos"]["form"] == "nibble"
    found = sfu_probe.check(tmp_path)
    assert found["all_rebuilt"] and found["sets"] == 11


def test_the_residual_code_keeps_exceptions_exactly():
    ref = torch.linspace(-3, 3, 1000)
    got = floats.fp32_from_bits(floats.bits(ref) + (torch.arange(1000) % 5) - 2)
    got[7], got[500] = float("nan"), 0.0  # far from the reference: kept as exceptions
    arrays, form = sfu_probe.encode(got, ref)
    assert form == "nibble" and arrays["ex_idx"].tolist() == [7, 500]
    assert torch.equal(floats.bits(sfu_probe.decode(arrays, form, ref)), floats.bits(got))


def test_the_ex2_hypotheses_find_the_rule_of_a_fake_unit():
    start = floats.bits(torch.tensor([0.3])).item()  # inputs on a 2^-25 grid: the cut of the fraction shows
    span = (start, start + (1 << 16))
    table = torch.zeros(1 << 24)  # the fake unit on the grid, where these inputs read it
    lo, hi = int(0.299 * 2**24), int(0.303 * 2**24)
    table[lo:hi] = _fake_ex2(sfu_probe.grid(1.0, "cpu")[lo:hi])
    tables = {"ex2": table, "rcp": torch.ones(1 << 23)}
    counts = sfu_sweeps.hypotheses(_fake_op, tables, "cpu", span, pairs=1 << 10)
    assert counts["ex2.floor_round23"].sum() == 0 and counts["ex2.floor_trunc23"].sum() > 0
    assert counts["ex2.histogram"].sum() == 1 << 16


def _model_op(op, x, y=None):
    """A fake unit that is the model but for one wrong output bit: of ex2 at 1.5, and of every div."""
    if op == "div":
        return floats.fp32_from_bits(floats.bits(sfu.div_full(x, y)) ^ 1)
    out = sfu_sweeps.MODELS[op](x)
    return torch.where(x == 1.5, floats.fp32_from_bits(floats.bits(out) ^ 1), out) if op == "ex2" else out


def test_the_model_check_counts_every_differing_output_and_keeps_examples():
    mid = floats.bits(torch.tensor([1.5])).item()
    span = (mid - (1 << 15), mid + (1 << 15))  # 2^16 patterns around 1.5
    record = sfu_sweeps.model_check(_model_op, "cpu", span, pairs=1 << 10)
    assert record["mismatches"] == {"ex2": 1, "rcp": 0, "log2": 0, "div.random": 1 << 10, "div.attention": 1 << 10}
    assert record["examples"]["ex2"] == [["0x3fc00000", "0x403504f2", "0x403504f3"]]
    assert record["inputs"]["ex2"] == 1 << 16 and record["buckets"]["ex2"] == {127: 1}
    assert len(record["examples"]["div.random"]) == sfu_sweeps.EXAMPLES


def test_the_references_of_nans_are_the_canonical_nan():
    # torch keeps a NaN's payload on the CPU; the GPU's residuals were taken against 0x7FFFFFFF
    x = floats.fp32_from_bits(torch.tensor([0x7F800369, 0x7FC00001, 0xFFC12345]))
    for op in ("ex2", "rcp", "log2"):
        assert floats.bits(sfu_sweeps.reference(op, x)).tolist() == [0x7FFFFFFF] * 3
    assert floats.bits(sfu_sweeps.reference("div", x, torch.ones(3))).tolist() == [0x7FFFFFFF] * 3


def test_the_fit_finds_the_interpolators_coefficients_from_their_outputs():
    for name, segment in (("ex2", 37), ("rcp", 101)):
        m, offset, sign, (c0, c1, c2) = mufu._table(name)
        n = 23 - m
        j = torch.arange(segment << n, (segment + 1) << n)
        C1, C2, lo, hi = mufu_fit.fit_segment(mufu.interpolate(name, j), n, sign)
        assert (c1[segment], c2[segment]) == (C1, C2) and lo <= (c0[segment] << 13) + offset < hi
