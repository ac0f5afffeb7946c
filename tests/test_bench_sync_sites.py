"""h3lab.bench.sync_sites' command line: bad values refused in one line, a CPU refused (the sites are CUDA's)."""

from __future__ import annotations

import pytest
import torch

from h3lab.bench import sync_sites


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--train-blocks", "0"]])
def test_bad_counts_are_one_line(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        sync_sites.main([*argv, "--out", str(tmp_path / "s.json")])
    assert stop.value.code == 2 and "allowed: rows >= 1, train blocks >= 1" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA says")
def test_a_cpu_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        sync_sites.main(["--train-blocks", "2"])
    assert stop.value.code == 2 and "no CUDA device; allowed: a GPU node" in capsys.readouterr().err


def test_too_few_rows_for_a_step_are_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        sync_sites.main(["--train-blocks", "2", "--rows", "1", "--config", "tiny"])
    assert stop.value.code == 2 and "--rows 1 for a training step; allowed: >= " in capsys.readouterr().err
