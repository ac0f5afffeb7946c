"""h3lab.checks: queued device conditions read together, refused in program order."""

import pytest
import torch

from h3lab.checks import Checks
from h3lab.ops.rows import has_duplicate_rows


def test_the_first_failing_check_in_program_order_refuses():
    c = Checks()
    made = []
    c.device(torch.tensor(True), "a", lambda: made.append("a") or "never made")
    c.device(torch.tensor(False), "b", lambda: "b failed")
    c.device(torch.tensor(False), "c", lambda: "c failed")
    with pytest.raises(ValueError, match=r"^b: b failed$"):
        c.read()
    assert made == []  # a passing check's message is not made


def test_a_host_refusal_comes_after_the_queued_checks_before_it():
    c = Checks()
    c.device(torch.tensor(False), "queued", lambda: "first in order")
    with pytest.raises(ValueError, match=r"^queued: first in order$"):
        c.host(False, "host", "second in order")
    c = Checks()
    c.device(torch.tensor(True), "queued", lambda: "passes")
    with pytest.raises(ValueError, match=r"^host: refused$"):
        c.host(False, "host", "refused")


def test_nothing_queued_reads_nothing_and_passing_checks_pass():
    c = Checks()
    c.read()
    c.host(True, "h", "x")
    c.device(torch.tensor([True]), "d", lambda: "x")
    c.read()


def test_duplicate_rows_are_found_in_any_order():
    g = torch.Generator().manual_seed(3)
    keys = torch.stack([torch.randint(0, 4, (64,), generator=g), torch.randperm(64, generator=g)], dim=1)
    assert not bool(has_duplicate_rows(keys))
    assert bool(has_duplicate_rows(torch.cat([keys, keys[17:18]])[torch.randperm(65, generator=g)]))
    assert not bool(has_duplicate_rows(keys[:1])) and not bool(has_duplicate_rows(keys[:0]))
    same_first = torch.tensor([[5, 1], [5, 2], [4, 1]])  # equal first keys, distinct rows
    assert not bool(has_duplicate_rows(same_first))


def test_a_check_made_once_is_not_made_again_for_the_same_unwritten_tensors():
    """device_once: the same tensors, unwritten, are not checked again after passing; a write (torch's
    version counter), another tensor, another check key, or a failure before the read checks again."""
    x = torch.tensor([1.0, 2.0])
    made: list[str] = []

    def once(t: torch.Tensor, key: str = "positive") -> Checks:
        c = Checks()
        c.device_once(key, (t,), lambda: made.append(key) or (t > 0).all(), "x", lambda: "not positive")
        return c

    once(x).read()
    once(x).read()
    assert made == ["positive"]
    once(x, "below 3").read()
    once(x.clone()).read()
    assert made == ["positive", "below 3", "positive"]
    x[0] = -1.0  # written: checked again, and refused
    with pytest.raises(ValueError, match=r"^x: not positive$"):
        once(x).read()
    with pytest.raises(ValueError, match=r"^x: not positive$"):  # a refusal remembers nothing
        once(x).read()
    with torch.inference_mode():
        y = torch.tensor([1.0])  # no version counter: checked every time
    once(y).read()
    once(y).read()
    assert made[-2:] == ["positive", "positive"]


def test_a_request_copied_with_new_rows_checks_those_rows_and_not_the_rest(monkeypatch):
    """ModelInputs.replace (a training step's noised sample): new NaN rows are refused; the unchanged
    keys are not sorted again (has_duplicate_rows runs once)."""
    from h3lab.config import H3Config
    from h3lab.model import inputs as inputs_module
    from h3lab.model import model_inputs

    calls = []
    real = inputs_module.has_duplicate_rows
    monkeypatch.setattr(inputs_module, "has_duplicate_rows", lambda k: calls.append(1) or real(k))
    first = model_inputs(H3Config.named("tiny"), seed=3)
    again = first.replace(video_rows=first.video_rows + 1)
    assert len(calls) == 1 and again.video_rows is not first.video_rows
    bad = first.video_rows.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"video_rows: holds inf or NaN"):
        first.replace(video_rows=bad)
