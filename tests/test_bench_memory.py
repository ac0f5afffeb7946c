"""The memory-peak locator (h3lab.bench.block_memory): replaying an allocator history, naming each
allocation's block part from its stack, the record. Its CPU side on synthetic histories and on the
stacks of a real (tiny, torch backend) block step; the `gpu` test checks the replay against the CUDA
allocator's own peak:  pytest -m gpu tests/test_bench_memory.py
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from h3lab.bench import block_memory as bm

ROOT = Path(bm.__file__).resolve().parents[2]


def _line_of(rel: str, text: str) -> int:
    """The 1-based line of `rel` (a repository file) holding `text`, so the tests follow the code."""
    lines = (ROOT / rel).read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (rel, text, hits)
    return hits[0]


def _frames(*calls: tuple[str, str, str]) -> list[dict]:
    """Torch's frame records, innermost first, from (file, function, a text on the line) outermost first."""
    return [{"filename": str(ROOT / f), "name": fn, "line": _line_of(f, text)} for f, fn, text in reversed(calls)]


BF, BB = "h3lab/block/forward.py", "h3lab/block/backward.py"
ATT_FWD = _frames(
    ("h3lab/block/step.py", "_block_step", "= forward(step, b, decided_rows)"),
    (BF, "forward", "attn, order = _attention_forward("),
    (BF, "_attention_forward", "be.attention_fwd(qr, k_c, v_c"),
)
FFN_FWD = _frames((BF, "forward", "out = _ffn_forward("), (BF, "_ffn_forward", 'h = tr("ff.hidden"'))
SWIGLU_BWD = _frames(
    ("h3lab/block/step.py", "_block_step", "= run_backward(step, b, rows"),
    (BB, "backward", "_ffn_backward(step, rows"),
    (BB, "_ffn_backward", "dh, dg = be.swiglu_bwd("),
    ("h3lab/triton/backend.py", "method", "return launcher(*args, **kwargs, node=self.node)"),
    ("h3lab/triton/elementwise.py", "swiglu_bwd", "def swiglu_bwd("),
)
KV_BWD = _frames((BB, "backward", "_attention_backward(step, rows, tape)"), (BB, "_attention_backward", "dk, dv = be."))


def _alloc(addr: int, size: int, frames: list[dict], op: str = "") -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames, "user_metadata": op}


def _free(action: str, addr: int, size: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": []}


HISTORY = [
    _alloc(0xA0, 100, ATT_FWD, "after attn.norm_k+rope"),
    _alloc(0xB0, 50, FFN_FWD),
    _free("free_requested", 0xF0, 30),  # allocated before the history: counts against the start
    _free("free_completed", 0xF0, 30),  # the same free, completed: counted once
    _alloc(0xC0, 200, SWIGLU_BWD, "after d.ff.swiglu"),
    {"action": "segment_alloc", "addr": 0x1000, "size": 2**21, "frames": []},  # reserved, not allocated
    _free("free_requested", 0xB0, 50),
    _free("free_completed", 0xB0, 50),
    _alloc(0xD0, 80, SWIGLU_BWD),  # the peak: 100 + 200 + 80 - 30
    _free("free_completed", 0xC0, 200),  # completed with no request recorded: counted here
    _alloc(0xE0, 200, KV_BWD),  # as high as the peak again: the first maximum stays the peak
    _free("free_requested", 0xA0, 100),
]


def test_replay_finds_the_first_peak_and_what_is_alive_at_it():
    r = bm.replay(HISTORY)
    assert r.extra == [100, 150, 120, 120, 320, 320, 270, 270, 350, 150, 350, 250]
    assert (r.peak_event, r.peak_bytes) == (8, 350)
    assert [(a.event, a.size, a.part) for a in r.live] == [
        (4, 200, "_ffn_backward"),
        (0, 100, "_attention_forward"),
        (8, 80, "_ffn_backward"),
    ]
    assert [(p["part"], p["first_event"], p["last_event"], p["max_bytes"]) for p in r.parts] == [
        ("_attention_forward", 0, 0, 100),
        ("_ffn_forward", 1, 1, 150),
        ("_ffn_backward", 4, 8, 350),
        ("_attention_backward", 10, 10, 350),
    ]


def test_replay_refuses_a_history_with_events_missing():
    with pytest.raises(ValueError, match="alloc at 0xa0, which is alive"):
        bm.replay([_alloc(0xA0, 1, []), _alloc(0xA0, 1, [])])


def test_the_record_names_the_peak_and_the_largest_tensors_alive_at_it():
    rec = bm.summarize(HISTORY, rows=10, top=2)
    assert (rec["peak_extra_bytes"], rec["peak_bytes_per_row"], rec["events"]) == (350, 35.0, len(HISTORY))
    code = "dh, dg = be.swiglu_bwd(da, h, g, act)"
    line = _line_of(BB, code)
    assert rec["peak"] == {
        "event": 8,
        "part": "_ffn_backward",
        "site": f"_ffn_backward (block/backward.py:{line}): {code}",
        "op": "",
        "alloc_bytes": 80,
    }
    live = rec["live_at_peak"]
    assert live["count"] == 3 and live["gib"] == 380 / 2**30
    assert live["by_part_gib"] == {"_ffn_backward": 280 / 2**30, "_attention_forward": 100 / 2**30}
    assert [(t["bytes"], t["part"], t["op"]) for t in live["top"]] == [
        (200, "_ffn_backward", "after d.ff.swiglu"),
        (100, "_attention_forward", "after attn.norm_k+rope"),
    ]
    assert rec["parts"][2]["max_gib"] == 350 / 2**30


def test_sites_name_the_part_the_step_called():
    """A helper inside a part (a frame deeper in the step's files) is charged to the part; the eager
    block's parts are its lines; an allocation outside every part file is named by its own frame."""
    helper = _frames(
        (BF, "forward", "st, mod = _adaln_table(step, b)"),
        (BF, "_adaln_table", "_table_rows(table, b.adaln_indices, column)"),
        (BF, "_table_rows", "return table[segment_R, column]"),
    )
    assert bm.site(helper)[0] == "_adaln_table"
    entry = _frames(("h3lab/block/step.py", "canonical_block", "dw = assemble_unit_grads("))
    assert bm.site(entry)[0] == "canonical_block"
    line = _line_of("h3lab/reference/eager.py", "grads = torch.autograd.grad(")
    part, where = bm.site(_frames(("h3lab/reference/eager.py", "eager_block", "grads = torch.autograd.grad(")))
    assert part == f"eager_block:{line}" and where.endswith(
        "grads = torch.autograd.grad(out, [x, temb, *p.values()], b.grad_out)"
    )
    assert bm.site([{"filename": "/x/torch/cuda/memory.py", "name": "empty", "line": 3}]) == (
        bm.NO_PART,
        "empty (/x/torch/cuda/memory.py:3)",
    )
    assert bm.site([]) == (bm.NO_PART, "(no Python frame)")


def test_sites_of_a_real_block_step_name_its_parts(tiny):
    """The stacks of a tiny canonical step (torch backend, CPU) at some of its kernels, as torch records
    them, name the part that called each kernel and its line."""
    from h3lab import packed_batch, synthetic_block
    from h3lab.backend import TorchBackend
    from h3lab.block import block_step
    from h3lab.comm import LocalComm
    from h3lab.units import unit_weights

    stacks: dict[str, list[dict]] = {}

    class Stacks(TorchBackend):
        def __getattribute__(self, name: str):
            value = super().__getattribute__(name)
            if callable(value) and not name.startswith("_") and name not in stacks:
                here = traceback.extract_stack()[:-1]
                stacks[name] = [{"filename": f.filename, "name": f.name, "line": f.lineno} for f in reversed(here)]
            return value

    block_step(
        unit_weights(synthetic_block(tiny, 0, seed=3)), packed_batch(tiny, 12, seed=4), LocalComm(), backend=Stacks()
    )
    want = {
        "silu": "_adaln_table",
        "rms_modulate_fwd": "_attention_forward",
        "swiglu_fwd": "_ffn_forward",
        "swiglu_bwd": "_ffn_backward",
        "attention_bwd_kv": "_attention_backward",
        "qk_norm_rope_bwd": "_qkv_backward",  # through its helper _qk_norm_rope_backward
        "mm_few_k": "_adaln_backward",
    }
    assert {name: bm.site(stacks[name])[0] for name in want} == want
    assert bm.site(stacks["swiglu_bwd"])[1].endswith(": dh, dg = be.swiglu_bwd(da, h, g, act)")


def test_arguments():
    a = bm.parse_args(["--out", "m.json", "--rows", "16384,32768", "--top", "5"])
    assert a.rows == [16384, 32768] and a.top == 5 and a.config == "real"
    for bad in (["--rows", "16384,"], ["--rows", "0"], ["--top", "0"]):
        with pytest.raises(SystemExit):
            bm.parse_args(["--out", "m.json", *bad])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            bm.main(["--out", "m.json"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_replayed_peak_is_the_allocators_and_names_its_line():
    keep = torch.empty(2**20, device="cuda")  # allocated before: freed inside, counted against the start

    def step() -> None:
        nonlocal keep
        a = torch.empty(3 * 2**20, device="cuda")
        keep = None
        b = torch.empty(5 * 2**20, device="cuda")  # the peak: 3 + 5 - 1 MiB of FP32
        del a, b

    events, stats = bm.record(step)
    r = bm.replay(events)
    assert r.peak_bytes == stats == (3 + 5 - 1) * 2**22
    assert r.live[0].size == 5 * 2**22 and "test_bench_memory.py" in bm.site(events[r.peak_event]["frames"])[1]
