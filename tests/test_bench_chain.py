"""h3lab.bench.chain_bench: its candidates and its refusal off a GPU (the timings need one)."""

from __future__ import annotations

import pytest
import torch

from h3lab.bench import chain_bench
from h3lab.triton.chain import CONFIG_KEYS
from h3lab.workbench.benchmarks import table


def test_every_candidate_is_a_whole_config_and_the_shapes_are_the_steps():
    assert all(set(t) == set(CONFIG_KEYS) for t in chain_bench.TILES)
    assert len({tuple(t.values()) for t in chain_bench.TILES}) == len(chain_bench.TILES)
    assert all(m > 0 and k > 0 and n > 0 for _, m, k, n, _ in chain_bench.SHAPES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA says")
def test_the_bench_refuses_a_machine_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="chain_bench needs a CUDA device"):
        chain_bench.main(["--out", str(tmp_path / "c.json")])
    assert not (tmp_path / "c.json").exists()


def test_the_table_shows_each_shape_and_the_fastest_tile():
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "UNROLL": 8, "num_warps": 4}
    shape = {"what": "head", "M": 4, "K": 5, "N": 6, "pinned_ms": 2.0, "cublas_fp32_ms": 0.1}
    shape |= {"fastest": tile | {"ms": 0.5}, "tiles": [tile | {"ms": 0.5, "bitwise": True}]}
    t = table("chain", {"format": chain_bench.BENCH_FORMAT, "shapes": [shape]})
    assert t.loc["head 4x5x6"].to_dict() == {
        "pinned ms": 2.0,
        "fastest ms": 0.5,
        "fastest tile": "16x32x8x4",
        "cuBLAS FP32 ms": 0.1,
        "all tiles bitwise": True,
    }
