"""The one GPU command's wrapper (h3lab.bench.sm90_probe) on a CPU: parts run in order, a failing part is
recorded without stopping the others, and the files are checked against what the device returns."""

from __future__ import annotations

import json

from h3lab.bench import sm90_probe


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path):
    def broken(out):
        raise RuntimeError("no such kernel")

    def writes(out):
        (out / "a.npz").write_bytes(b"x" * 100)
        return {"files": {"a.npz": 100}}

    summary = sm90_probe.run(tmp_path, ["mma", "tree"], {"mma": broken, "tree": writes}, {"node_type": "test"})
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["status"] == summary["status"] == "failed"
    assert on_disk["parts"]["mma"]["error"] == "RuntimeError: no such kernel"
    assert on_disk["parts"]["tree"]["status"] == "passed" and on_disk["fits_limits"]
    assert set(on_disk["files"]) == {"a.npz", "summary.json"}
    (tmp_path / "big.bin").write_bytes(b"0" * (16 << 20 | 1))
    assert not sm90_probe.files_record(tmp_path)["fits_limits"]


def test_every_part_has_a_runner():
    assert set(sm90_probe._runners("cpu")) == set(sm90_probe.PARTS)
