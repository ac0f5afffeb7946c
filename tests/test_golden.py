"""Golden digests: this machine reproduces the published CPU bits; a changed problem is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest

from h3lab.cli import main
from h3lab.run import golden


def test_this_cpu_reproduces_the_published_digests(capsys):
    res = golden.verify("torch", "cpu")
    assert res["node_type"] == "CPU" and res["match"] and res["first_mismatch"] is None
    assert list(res["tensors"])[:3] == ["out", "dx", "dtemb"] and len(res["tensors"]) == 15 + 6  # + 3 steps x 2
    assert main(["verify"]) == 0
    assert "reproduces the published bits" in capsys.readouterr().out


def test_a_different_problem_is_named_at_its_first_differing_tensor(monkeypatch):
    monkeypatch.setattr(golden, "REFERENCE", replace(golden.REFERENCE, seed=1))  # other packed rows
    res = golden.verify("torch", "cpu")
    assert not res["match"] and res["first_mismatch"] == "out"


def test_an_unpublished_backend_raises():
    with pytest.raises(ValueError, match="no golden digests for node type 'CPU' and backend 'baseline'"):
        golden.verify("baseline", "cpu")
