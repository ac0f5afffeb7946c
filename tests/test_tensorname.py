"""The tensor-name grammar (h3lab.tensorname): every name a run gives a tensor parses and formats back
to itself, with its step, block, body and unit; its readers (the runner's reassembly, the per-step
verdicts, the trace's timeline) read those fields."""

from __future__ import annotations

import pytest

from h3lab.config import model_param_shapes
from h3lab.run.steps import step_kind
from h3lab.run.tasks import space_of
from h3lab.tensorname import TensorName
from h3lab.train.pieces import canonical_pieces, piece_label
from tests.train_ranks import NARROW

EXAMPLES = [
    ("out", TensorName("out")),
    ("block3.dtemb", TensorName("dtemb", block=3)),
    ("dw.attn.to_q.weight", TensorName("dw.attn.to_q.weight")),
    ("block0.dw.q@u7", TensorName("dw.q", block=0, unit=7)),
    ("step2.block1.w.ff.gate@u3", TensorName("w.ff.gate", step=2, block=1, unit=3)),
    ("step1.loss.video", TensorName("loss.video", step=1)),
    ("step10.dw.proj_in.weight", TensorName("dw.proj_in.weight", step=10)),
    ("step0.video", TensorName("video", step=0)),
    ("block12.d.ff.net.2", TensorName("d.ff.net.2", block=12)),
    # no step or block: a body that only looks like one, kept whole
    ("step01.x", TensorName("step01.x")),
    ("blocks.x", TensorName("blocks.x")),
    ("block2.step3.x", TensorName("step3.x", block=2)),
    ("dw.x@u", TensorName("dw.x@u")),
    ("dw.x@u01", TensorName("dw.x@u01")),
]


@pytest.mark.parametrize(("text", "name"), EXAMPLES)
def test_a_name_parses_to_its_fields_and_formats_back(text, name):
    assert TensorName.parse(text) == name and str(name) == text


def test_kind_and_param_belong_to_gradients_and_weights():
    n = TensorName.parse("step2.block1.w.ff.gate@u3")
    assert (n.kind, n.param, n.unit_slice) == ("w", "ff.gate", True)
    assert (TensorName.parse("block0.dw.norm1.weight").kind, TensorName.parse("dwx.y").kind) == ("dw", None)
    assert not TensorName.parse("dtemb").unit_slice and TensorName.parse("dtemb").param is None


def test_every_name_a_training_run_reports_round_trips():
    """The pieces of a trained depth, as gradients and weights of two steps (h3lab.train.step's names)."""
    pieces = canonical_pieces(NARROW, [0, 1], list(model_param_shapes(NARROW, 0)))
    names = [f"step{k}.{piece_label(p, kind)}" for k in (1, 2) for p in pieces for kind in ("dw", "w")]
    for text in names:
        n = TensorName.parse(text)
        assert str(n) == text and n.step in (1, 2) and n.kind in ("dw", "w")
    by_piece = {(p.block, p.name, p.unit): p for p in pieces}
    assert all((TensorName.parse(piece_label(p)).block, p.name, p.unit) in by_piece for p in pieces)


def test_the_readers_take_the_fields_apart():
    assert step_kind("step2.block1.w.ff.gate@u3") == (2, "weights")
    assert step_kind("step1.loss.video") == (1, "loss") and step_kind("block0.dw.q@u1") is None
    assert [space_of(n) for n in ("out", "block1.dw.q@u2", "block1.dw.norm1.weight", "dw.x@u")] == [
        "local",
        "unit",
        "replicated",
        "replicated",
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"body": ""}, r"tensor name body ''; allowed: a non-empty name"),
        ({"body": "x", "step": -1}, r"step=-1; allowed: None or an int >= 0"),
        ({"body": "x", "unit": True}, r"unit=True; allowed: None or an int >= 0"),
    ],
)
def test_bad_names_are_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorName(**kwargs)
    with pytest.raises(ValueError, match=r"tensor name ''; allowed: \[step\{k\}\.\]\[block\{i\}\.\]<body>"):
        TensorName.parse("")
