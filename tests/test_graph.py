"""h3lab.block.graph: the canonical block captured in a CUDA graph gives the eager step's bytes.

The capture needs a GPU and compiled kernels (`gpu` tests, skipped without CUDA and under the
Triton interpreter); the refusals that need no GPU run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from h3lab import H3Config, canonical_block, packed_batch, synthetic_block
from h3lab.backend import get_backend
from h3lab.batch import FIELDS, PackedBatch
from h3lab.block.graph import GraphedBlock, capture
from h3lab.triton import configs
from tests.conftest import assert_bitwise

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or configs.interpreting(),
    reason="needs a CUDA device and compiled kernels (TRITON_INTERPRET unset): pytest -m gpu tests/test_graph.py",
)


def test_a_graph_needs_a_cuda_batch_and_a_warm_up(tiny_weights, tiny_batch):
    with pytest.raises(ValueError, match="allowed: a CUDA device"):
        GraphedBlock(tiny_weights, tiny_batch)
    with pytest.raises(ValueError, match=r"warmup=0; allowed: >= 1"):
        capture(lambda: None, warmup=0)


def test_the_torch_backend_refuses_a_decided_row_plan(tiny_weights, tiny_batch):
    with pytest.raises(ValueError, match="allowed: backend 'triton'"):
        canonical_block(tiny_weights, tiny_batch, backend=get_backend("torch"), decided_rows=object())


def _fresh(b: PackedBatch, seed: int, perm: torch.Tensor | None = None) -> PackedBatch:
    """New activations, the rows permuted by `perm` (the same row signature when padding rows stay
    padding): what a replay may change."""
    g = torch.Generator(device=b.device).manual_seed(seed)
    new = {
        k: torch.randn(getattr(b, k).shape, generator=g, device=b.device).to(getattr(b, k).dtype)
        for k in ("hidden_states", "temb", "grad_out")
    }
    fresh = PackedBatch(adaln_indices=b.adaln_indices, position_ids=b.position_ids, logical_keys=b.logical_keys, **new)
    return fresh if perm is None else fresh.rows(perm.to(b.device))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tiny", "real"])  # real: the Gluon unit-tree kernel runs (unit widths % 64)
def test_gpu_a_replay_gives_the_eager_steps_bytes(config):
    torch.backends.cuda.matmul.allow_tf32 = False
    c = H3Config.named(config)
    w = synthetic_block(c, 0, seed=5).to("cuda")
    b = packed_batch(c, 264, seed=6, padding=9).to("cuda")  # padding: the weight gradients gather rows
    graphed = GraphedBlock(w, b)
    perm = torch.randperm(b.num_rows, generator=torch.Generator().manual_seed(4))
    outs = []
    # activations, then also the rows' order (so keys, AdaLN indices, positions) change between replays
    for seed, nb in ((7, _fresh(b, 7)), (8, _fresh(b, 8, perm)), (9, _fresh(b, 9))):
        early = None
        if seed == 9:  # decided ahead on another stream, as a training loop would while a replay runs
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())  # nb's metadata is on the device
            with torch.cuda.stream(side):
                early = graphed.decide(nb)
        got = {k: t.clone() for k, t in graphed(nb, decided_rows=early).tensors().items()}
        want = canonical_block(w, nb, backend=get_backend("triton", nb.device)).tensors()
        assert got.keys() == want.keys()
        for k in want:
            assert_bitwise(got[k], want[k], f"{config} draw {seed}: {k}")
        outs.append(got["out"])
    assert not torch.equal(outs[0], outs[2]), "a replay returned an earlier draw's output"
    with pytest.raises(ValueError, match=r"hidden_states: .*allowed: .*as captured"):
        graphed(b.rows(slice(0, b.num_rows - 1)))
    fields = {k: getattr(b, k) for k in FIELDS}
    as_f32 = {k: fields[k].float() for k in ("hidden_states", "grad_out")}
    with pytest.raises(ValueError, match=r"hidden_states: torch.float32 .*allowed: torch.bfloat16"):
        graphed(PackedBatch(**{**fields, **as_f32}))
    keys = b.logical_keys.clone()
    keys[0] = torch.tensor([-1, 10**6])  # one row fewer active
    more_padding = PackedBatch(**{**fields, "logical_keys": keys})
    with pytest.raises(ValueError, match=r"row signature \(active rows, in place\) \(263, False\); allowed: \(264"):
        graphed(more_padding)
    stale = graphed.decide(b)
    with pytest.raises(ValueError, match="not the tensor the plan was decided from"):
        graphed(_fresh(b, 10, perm), decided_rows=stale)


@gpu
@pytest.mark.gpu
def test_gpu_rows_in_canonical_order_are_their_own_signature():
    """Without padding, rows in key order are read in place: one capture replays other batches in key
    order (new activations, AdaLN indices and positions) with the eager bytes; a permuted batch
    launches a gather, so it needs its own capture; the refusal says so."""
    torch.backends.cuda.matmul.allow_tf32 = False
    c = H3Config.tiny()
    w = synthetic_block(c, 0, seed=5).to("cuda")
    b = packed_batch(c, 100, seed=6).to("cuda")
    graphed = GraphedBlock(w, b)
    assert graphed.captured_signature == (100, True)
    shuffle = torch.randperm(b.num_rows, generator=torch.Generator().manual_seed(3)).to("cuda")
    fresh = _fresh(b, 7)
    in_order = PackedBatch(
        **{
            **{k: getattr(fresh, k) for k in FIELDS},
            "adaln_indices": b.adaln_indices[shuffle],
            "position_ids": b.position_ids[shuffle],
        }
    )
    for nb in (fresh, in_order):
        got = {k: t.clone() for k, t in graphed(nb).tensors().items()}
        want = canonical_block(w, nb, backend=get_backend("triton", nb.device)).tensors()
        for k in want:
            assert_bitwise(got[k], want[k], k)
    perm = torch.randperm(b.num_rows, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match=r"\(100, False\); allowed: \(100, True\)"):
        graphed(_fresh(b, 8, perm))
