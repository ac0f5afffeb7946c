"""The global gradient norm: close to float64, the same bits for every split of the 8 units over TP ranks,
its pieces in the canonical order, and the clip coefficient's formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from h3lab.backend import get_backend
from h3lab.comm import LocalComm
from h3lab.config import NUM_UNITS, H3Config
from h3lab.ops import squares
from h3lab.ops.fixed import sqrt_f32
from h3lab.ops.squares import sum_of_squares
from h3lab.train.clip import clip_coefficient, global_grad_norm, to_f32
from h3lab.train.pieces import Piece, canonical_pieces, piece_label, rank_pieces
from tests.conftest import assert_bitwise
from tests.train_ranks import for_units, model_weights, random_grads, run_ranks

BE = get_backend("torch")

U24 = 2.0**-24  # FP32 unit roundoff


def _tree_bound(n: int) -> float:
    """Relative error bound of an FP32 sum of n non-negative terms by balanced trees (depth <= log2 n + 1
    over both levels: row blocks, then blocks), each term an FP32 square (one rounding): (depth + 1) u."""
    return (math.ceil(math.log2(max(n, 2))) + 2) * U24


@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (1025,), (33, 17), (3001, 37)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_of_squares_matches_float64(shape, dtype):
    g = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    got = float(sum_of_squares(g))
    ref = float((g.double() ** 2).sum())
    # every term is >= 0, so the FP32 rounding errors bound the relative error: _tree_bound's reason
    assert abs(got - ref) <= _tree_bound(g.numel()) * ref


def test_sum_of_squares_chunks_and_strides_change_no_bit(monkeypatch):
    g = torch.randn(517, 301, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = sum_of_squares(g)
    monkeypatch.setattr(squares, "_SQUARES_CHUNK", 3)  # chunks bound memory; each row block's tree is its own
    assert_bitwise(sum_of_squares(g), whole, "chunked")
    wide = torch.randn(301, 2000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cols = wide[:, 700:1217]  # a unit's columns: a strided view, read in row-major order
    assert_bitwise(sum_of_squares(cols.t().contiguous().t()), sum_of_squares(cols.contiguous()), "layout")
    assert_bitwise(sum_of_squares(cols), sum_of_squares(cols.contiguous()), "strided view")


@pytest.fixture(scope="module")
def model():
    config = H3Config.tiny().replace(num_layers=2, num_refiner_layers=1)
    weights = model_weights(config, range(2), range(NUM_UNITS), seed=5)
    return config, weights, random_grads(weights, config, seed=6, scale=1e-2)


def test_global_norm_matches_float64_in_canonical_order(model):
    config, _, grads = model
    gn = global_grad_norm(grads, LocalComm(), config, BE)
    assert gn.order == canonical_pieces(config, {0, 1}, {p.name for p in grads if p.block is None})
    labels = [piece_label(p) for p in gn.order]
    assert labels[0] == "proj_in.weight" and labels[-1] == "audio_proj_out.bias"
    k = labels.index("block1.ff.hidden@u0")
    assert labels[k - 1 : k + 3] == [
        "block1.norm2.weight",
        "block1.ff.hidden@u0",
        "block1.ff.gate@u0",
        "block1.ff.hidden@u1",
    ]
    assert labels.index("token_refiner.final_norm.weight") < labels.index("block0.norm1.weight")
    assert labels.index("block1.adaln_proj.linear.bias@u7") < labels.index("norm_out.norm.weight")
    for p, s in zip(gn.order, gn.piece_sums, strict=True):
        assert_bitwise(s, sum_of_squares(grads[p]), piece_label(p))
    ref = math.sqrt(sum(float((t.double() ** 2).sum()) for t in grads.values()))
    n_max = max(t.numel() for t in grads.values())
    # the pieces' sums are added by one more balanced tree; sqrt halves the relative error and rounds once
    bound = (_tree_bound(n_max) + _tree_bound(len(gn.order))) / 2 + U24
    assert abs(float(gn.norm) - ref) <= bound * ref
    assert_bitwise(gn.norm, sqrt_f32(gn.total), "norm: the correctly rounded root")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_global_norm_is_bitwise_for_every_tp_split(model, tp):
    config, _, grads = model
    canon = global_grad_norm(grads, LocalComm(), config, BE)

    def rank(r, comm):
        return global_grad_norm(for_units(grads, comm.units), comm, config, BE)

    for r, gn in enumerate(run_ranks(tp, rank)):
        assert_bitwise(gn.norm, canon.norm, f"tp{tp} rank {r} norm")
        assert_bitwise(gn.piece_sums, canon.piece_sums, f"tp{tp} rank {r} piece sums")
        assert gn.order == canon.order


def test_global_norm_refuses_pieces_a_rank_does_not_hold(model):
    config, _, grads = model
    mine = for_units(grads, range(2, 4))
    missing = {p: t for p, t in mine.items() if p != Piece(0, "ff.gate", 3)}
    with pytest.raises(ValueError, match=r"missing \['block0.ff.gate@u3'\], unexpected \[\]"):
        rank_pieces(config, missing, range(2, 4))
    foreign = mine | {Piece(1, "attn.to_q.weight", 5): grads[Piece(1, "attn.to_q.weight", 5)]}
    with pytest.raises(ValueError, match=r"unexpected \['block1.attn.to_q.weight@u5'\]"):
        rank_pieces(config, foreign, range(2, 4))
    with pytest.raises(ValueError, match=r"\['lm_head.weight'\] are not non-block parameters"):
        canonical_pieces(config, [0], ["lm_head.weight"])
    with pytest.raises(ValueError, match="no gradients"):
        global_grad_norm({}, LocalComm(), config, BE)


def test_clip_coefficient_formula():
    for norm, max_norm in ((0.75, 1.0), (2.99999, 3.0), (1e-3, 2.5), (0.0, 1e-3)):  # below: exactly 1
        assert clip_coefficient(torch.tensor(norm), max_norm).item() == 1.0
    # torch's formula: at norm == max_norm the 1e-6 already scales (by 1 - 1e-6 / max_norm, in FP32)
    assert clip_coefficient(torch.tensor(3.0), 3.0).item() == float(
        np.float32(3.0) / (np.float32(3.0) + np.float32(1e-6))
    )
    for norm, max_norm in ((1.7320508, 1.0), (123.456, 0.3), (1e30, 1e-3)):
        got = clip_coefficient(torch.tensor(norm, dtype=torch.float32), max_norm)
        n32 = np.float32(norm)
        want = np.float32(max_norm) / (n32 + np.float32(1e-6))  # numpy FP32: one IEEE add, one IEEE divide
        assert got.dtype == torch.float32 and got.item() == float(want)
        torch_coef = max_norm / (float(n32) + 1e-6)  # clip_grad_norm_'s formula in float64
        assert abs(got.item() - torch_coef) <= 2 * U24 * torch_coef  # FP32 roundings of the add and divide
    assert clip_coefficient(torch.tensor(1e30), math.inf).item() == 1.0
    assert math.isnan(clip_coefficient(torch.tensor(math.nan), 1.0).item())
    assert clip_coefficient(torch.tensor(math.inf), 1.0).item() == 0.0
    for bad in (0.0, -1.0, math.nan, True, "1"):
        with pytest.raises(ValueError, match=r"max_grad_norm .* not allowed; allowed: a number in \(0, inf\]"):
            clip_coefficient(torch.tensor(1.0), bad)


def test_to_f32_rounds_to_nearest_float32():
    assert to_f32(0.1) == float(np.float32(0.1))
    assert to_f32(1e39) == math.inf and to_f32(-1e39) == -math.inf and to_f32(math.inf) == math.inf
    assert to_f32(3.4028235e38) == float(np.finfo(np.float32).max)
