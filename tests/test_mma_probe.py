"""The MMA probe's data flow on a CPU (h3lab.bench.mma_probe, mma_cases, probe_rng), with fake GPU data
made by the model itself: what a GPU run writes, the offline checker reads back, and a planted
difference is counted on both sides. The probe kernels are compiled for sm90 by the last test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from h3lab.bench import mma_cases, mma_probe
from h3lab.bench.probe_rng import Stream
from h3lab.emulate import floats
from h3lab.io.jsonfile import write_json

SMALL = mma_cases.Tile("small", 16, 16, 16, 4, True, False, "test")


def _cases() -> list[mma_cases.Case]:
    C = mma_cases.Case
    return [
        C("random", SMALL, "bf16", "load", 40, 2, "random", 1),
        C("none", SMALL, "bf16", "none", 32, 1, "random", 2),
        C("zeros", SMALL, "bf16", "zeros", 16, 1, "random", 3),
        C("fp16", SMALL, "fp16", "load", 32, 1, "random", 4),
        C("fp32", SMALL, "fp32", "load", 40, 1, "random", 5),
        *[C(r, SMALL, "bf16", "load", 32, 1, r, 10 + i) for i, r in enumerate(mma_cases.ADVERSARIAL)],
    ]


def _model_executor(flip: str | None = None):
    def run(case, a, b, c):
        out = mma_probe.expected(case, a, b, next(iter(mma_probe.interpretations(case, c).values())))
        if case.name == flip:  # planted differences: the last bit of each row's first element
            bit = torch.zeros(out.shape, dtype=torch.int64)
            bit[..., 0] = 1
            out = floats.fp32_from_bits(floats.bits(out) ^ bit)
        return out

    return run


def _write_mma(tmp_path, flip=None):
    variants = {"sm90": mma_probe.SM90, "extra_bits_1": mma_probe.VARIANTS["extra_bits_1"]}
    records, outputs = mma_probe.run(_cases(), _model_executor(flip), "cpu", variants)
    mma_probe.save(tmp_path, outputs)
    write_json(tmp_path / "summary.json", {"parts": {"mma": {"records": records}}})
    return records


def test_mma_cases_redraw_alike_and_the_checker_reads_the_outputs_back(tmp_path):
    records = _write_mma(tmp_path)
    assert all(next(iter(r["mismatches"].values())) == 0 for r in records)
    assert sum(r["variants"]["extra_bits_1"] for r in records if r["dtype"] == "bf16") > 0  # a wrong reading shows
    found = mma_probe.check(tmp_path)
    assert found["inputs_reproduced"] and found["cases"] == len(_cases())
    assert all(r["mismatches"] == 0 for r in found["rows"])


def test_a_planted_difference_is_counted_on_both_sides(tmp_path):
    records = _write_mma(tmp_path, flip="random")
    bad = {r["name"]: next(iter(r["mismatches"].values())) for r in records}
    assert bad["random"] == 2 * 16 and sum(bad.values()) == 32  # one element per row of each of 2 tiles
    example = next(r for r in records if r["name"] == "random")["examples"][0]
    assert int(example["gpu"], 16) ^ int(example["model"], 16) == 1
    rows = {r["name"]: r["mismatches"] for r in mma_probe.check(tmp_path)["rows"]}
    assert rows["random"] == 32 and sum(rows.values()) == 32


def test_the_probe_cases_cover_a_million_random_dots_and_every_adversarial_recipe():
    cases = mma_cases.probe_cases()
    assert sum(c.dots for c in cases if c.recipe == "random" and c.dtype == "bf16") >= 10**6
    assert {c.recipe for c in cases} == set(mma_cases.RECIPES)
    assert len({c.seed for c in cases}) == len(cases) and len({c.name for c in cases}) == len(cases)
    tiles = {(t.BM, t.BN, t.warps) for t in mma_cases.kernel_tiles()}
    assert {(128, 256, 8), (64, 256, 4), (64, 16, 4), (128, 128, 8), (64, 32, 4)} <= tiles


def test_another_seed_base_draws_every_case_afresh():
    """The same cases (names, tiles, recipes) from other seeds: inputs the model was not read from."""
    base, fresh = mma_cases.probe_cases(), mma_cases.probe_cases(seed_base=7000)
    assert [c.name for c in fresh] == [c.name for c in base]
    assert [c.seed for c in fresh] == [7000 + i for i in range(len(base))]
    assert not {c.seed for c in fresh} & {c.seed for c in base}
    a, a2 = base[0].inputs("cpu")[0], fresh[0].inputs("cpu")[0]
    assert not torch.equal(a, a2) and a.shape == a2.shape


def test_probe_rng_is_one_stream_per_seed():
    a, b = Stream(3), Stream(3)
    assert torch.equal(torch.cat([a.bits((5,)), a.bits((3,))]), b.bits((8,)))
    assert not torch.equal(Stream(4).bits((8,)), Stream(3).bits((8,)))
    assert Stream(3).bits((2,)).tolist() == [3646323588, 602182750]  # the bits themselves are the contract


def test_the_probe_kernels_compile_for_sm90():
    """The probe kernels build for GPUTarget("cuda", 90, 32) with the installed Triton (a subprocess:
    the test session interprets kernels), A from registers where the kernels have it, and scale-d 0
    on the first step of a dot without accumulator."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json; from h3lab.bench import mma_probe, sfu_probe, tree_probe;"
        "built = mma_probe.compile_only(tiles={'att32_pv', 'issue_64x64'});"
        "print(json.dumps(built + sfu_probe.compile_only() + tree_probe.compile_only()))"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    ops = {o for b in built for o in b.get("flagged", [])}
    assert {"ex2.approx.ftz.f32", "rcp.approx.ftz.f32", "div.full.f32"} <= ops
    forms = {m["operands"] for b in built for m in b.get("mma", [])}
    assert {"A smem, scale-d 0", "A smem, scale-d 1", "A regs, scale-d 1"} <= forms
