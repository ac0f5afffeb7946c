"""The contract's rule 6 with one host sync per model call: `h3lab.finite.deferred_checks` refuses the
same inputs with the same messages as the immediate checks, at the scope's end, first cause first."""

from __future__ import annotations

import math

import pytest
import torch

from h3lab import H3Config, packed_batch
from h3lab.batch import PackedBatch
from h3lab.finite import check_counts, deferred_checks


@pytest.fixture
def batch() -> PackedBatch:
    return packed_batch(H3Config.tiny(), 24, seed=31, padding=3)


def _with_nan(t: torch.Tensor, row: int) -> torch.Tensor:
    t = t.clone()
    t[row, 2] = math.nan
    return t


def test_with_rows_refuses_a_nan_in_an_active_row_at_once_outside_a_scope(batch):
    with pytest.raises(ValueError, match=r"^hidden_states: 1 active rows hold NaN or Inf; allowed: finite"):
        batch.with_rows(hidden_states=_with_nan(batch.hidden_states, 4))
    padded = batch.with_rows(hidden_states=_with_nan(batch.hidden_states, batch.num_rows - 1))  # padding row
    assert padded.logical_keys is batch.logical_keys and padded.temb is batch.temb


def test_with_rows_refuses_another_shape_dtype_or_device(batch):
    h = batch.hidden_states
    with pytest.raises(
        ValueError,
        match=r"^hidden_states: torch.bfloat16 \[23, 192\] on cpu; allowed: torch.bfloat16 \[27, 192\] on cpu",
    ):
        batch.with_rows(hidden_states=h[:-4])
    with pytest.raises(ValueError, match=r"^grad_out: torch.float32 .*allowed: torch.bfloat16"):
        batch.with_rows(grad_out=batch.grad_out.float())


def test_a_deferred_refusal_waits_for_the_scope_and_names_the_first_check(batch):
    reached = []
    with pytest.raises(ValueError, match=r"^grad_out: 1 active rows hold NaN or Inf") as err, deferred_checks():
        b = batch.with_rows(grad_out=_with_nan(batch.grad_out, 0))
        b.with_rows(hidden_states=_with_nan(batch.hidden_states, 1))  # a later check, also refused
        reached.append(True)
    assert reached == [True] and err.value.__cause__ is None


def test_an_error_after_a_deferred_refusal_is_chained_to_it(batch):
    with pytest.raises(ValueError, match=r"^hidden_states: 1 active rows hold NaN") as err, deferred_checks():
        batch.with_rows(hidden_states=_with_nan(batch.hidden_states, 2))
        raise RuntimeError("what the NaN caused later")
    assert isinstance(err.value.__cause__, RuntimeError)


def test_an_error_without_a_refusal_propagates_unchanged_and_nested_scopes_join(batch):
    seen: list[list[int]] = []
    with pytest.raises(KeyError), deferred_checks():
        with deferred_checks():  # joins the outer one: nothing read when it ends
            check_counts(torch.tensor([0, 0]), seen.append)
        assert seen == []
        raise KeyError("x")
    assert seen == [[0, 0]]  # read once, as the outer scope ended
    with deferred_checks():
        check_counts(torch.tensor([0]), seen.append)
    assert seen == [[0, 0], [0]]
