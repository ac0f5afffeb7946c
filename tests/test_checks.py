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
