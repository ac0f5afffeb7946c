"""A request's key orders (ModelInputs.key_order): each part's rows in ascending logical-key order,
sorted once per request and shared by the copies `replace` makes without touching the keys (a
training step's noised sample), so the step's glue sorts no keys after its first step."""

from __future__ import annotations

import itertools

import pytest
import torch

from h3lab.config import H3Config
from h3lab.model.inputs import KEY_PARTS
from h3lab.model.packing import request_of_rows
from h3lab.ops.rows import key_order


@pytest.fixture
def inputs():
    return request_of_rows(H3Config.named("tiny"), 400, 3)


def _keys(inputs, part: str):
    k = inputs.logical_keys
    if part == "video+audio":
        return torch.cat([k[inputs.video_indices], k[inputs.audio_indices]])
    modality, _, generated = part.partition(".")
    idx = getattr(inputs, f"{modality}_indices")
    return k[idx[getattr(inputs, f"num_condition_{modality}_rows") :] if generated else idx]


def test_every_part_is_the_key_order_of_its_keys(inputs):
    for part in KEY_PARTS:
        assert torch.equal(inputs.key_order(part), key_order(_keys(inputs, part))), part


def test_each_part_orders_its_own_rows_by_ascending_key(inputs):
    """Independently of key_order: every row of the part once, keys strictly ascending (lexicographic)."""
    nv, na = inputs.video_rows.shape[0], inputs.audio_rows.shape[0]
    counts = {"video": nv, "audio": na, "text": inputs.text_rows.shape[0], "video+audio": nv + na}
    counts |= {"video.generated": nv - inputs.num_condition_video_rows}
    counts |= {"audio.generated": na - inputs.num_condition_audio_rows}
    for part, n in counts.items():
        order = inputs.key_order(part)
        assert sorted(order.tolist()) == list(range(n)), part
        keys = [tuple(k) for k in _keys(inputs, part)[order].tolist()]
        assert all(a < b for a, b in itertools.pairwise(keys)), part


def test_a_copy_that_keeps_the_keys_shares_the_orders_and_one_that_changes_them_does_not(inputs):
    first = inputs.key_order("video")
    noised = inputs.replace(video_rows=torch.randn_like(inputs.video_rows))
    assert noised.key_order("video") is first  # sorted once
    audio = noised.key_order("audio")
    assert inputs.key_order("audio") is audio  # shared both ways
    flipped = inputs.logical_keys.clone()
    flipped[:, 1] = -flipped[:, 1]  # another key order within each first key
    other = inputs.replace(logical_keys=flipped)
    assert other.key_order("video") is not first
    assert torch.equal(other.key_order("video"), key_order(flipped[other.video_indices]))


def test_a_part_outside_the_parts_is_refused(inputs):
    with pytest.raises(ValueError, match=r"key_order part 'image'; allowed: \['video', 'audio', 'text'"):
        inputs.key_order("image")


def test_key_orders_carry_their_index_facts_and_a_write_forgets_them(inputs, monkeypatch):
    """The row reductions check each key order from facts told when it was made (no host sync per use);
    a tensor written since, or another tensor, is computed afresh."""
    from h3lab import rowplan

    orders = {part: inputs.key_order(part) for part in KEY_PARTS}
    real = rowplan._facts_of
    monkeypatch.setattr(rowplan, "_facts_of", lambda t: pytest.fail("a key order's facts read back again"))
    for part, order in orders.items():
        host = order.tolist()
        assert rowplan.index_facts(order) == (min(host), max(host), host == list(range(len(host)))), part
    monkeypatch.setattr(rowplan, "_facts_of", real)
    written = inputs.key_order("text")
    written.add_(0)  # an in-place write: the version counter moves
    computed = []
    monkeypatch.setattr(rowplan, "_facts_of", lambda t: computed.append(t) or real(t))
    rowplan.index_facts(written)
    rowplan.index_facts(written.clone())
    assert len(computed) == 2
    n = len(rowplan._KNOWN)
    del orders, order, written
    inputs.__dict__.pop("_key_orders")
    assert len(rowplan._KNOWN) < n  # a freed order leaves the registry
