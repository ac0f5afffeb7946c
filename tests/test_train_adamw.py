"""AdamW on FP32 masters per piece: torch.optim.AdamW's algorithm, the same bytes for every split of the
8 units over TP ranks and for a piece updated whole or in slices, a refused step on a non-finite
gradient, one clear error per bad hyperparameter. Over gloo, in the ranks of a layout: tests/test_train_run.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from h3lab.backend import get_backend
from h3lab.comm import LocalComm
from h3lab.config import NUM_UNITS
from h3lab.ops.adamw import adamw_update
from h3lab.ops.fixed import round_to
from h3lab.train.adamw import AdamW, AdamWHyper, NonFiniteGradError, NonFiniteWeightError, PieceState, step_scalars
from h3lab.train.pieces import Piece, block_grad_pieces, block_weight_pieces, piece_label
from h3lab.units import unit_weights
from tests.conftest import assert_bitwise
from tests.train_ranks import NARROW, for_units, model_weights, random_grads, run_ranks

CONFIG = NARROW.replace(num_layers=2)
ALL = range(NUM_UNITS)
BE = get_backend("torch")


def _weights(units: range = ALL) -> dict[Piece, torch.Tensor]:
    return model_weights(CONFIG, range(2), units, seed=21)


def test_step_matches_torch_adamw_on_fp32_masters():
    hyper = AdamWHyper(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, max_grad_norm=0.5)
    weights = _weights()
    opt = AdamW(weights, config=CONFIG, comm=LocalComm(), hyper=hyper, backend=BE)
    params = {p: torch.nn.Parameter(w.detach().to(torch.float32).clone()) for p, w in weights.items()}
    ref = torch.optim.AdamW(
        list(params.values()), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False
    )
    steps = 5
    for t in range(steps):
        grads = random_grads(weights, CONFIG, seed=100 + t, scale=1e-5 if t % 2 else 1e-2)  # clips, then not
        record = opt.step(grads)
        for p, q in params.items():
            q.grad = grads[p].to(torch.float32)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5, foreach=False)
        ref.step()
        # torch's norm sums in its own order (vector_norm): the same value within FP32 summation error
        assert abs(float(record.grad_norm) - float(ref_norm)) <= 1e-5 * float(ref_norm)
        assert (float(record.clip_coef) < 1.0) == (t % 2 == 0)
    for p, q in params.items():
        st = opt.state[p]
        # torch fuses lerp_ (m), addcmul_ (v) and addcdiv_ (update) and multiplies by the clip coefficient's
        # reciprocal; each differs from our separate ops by at most a few FP32 roundings (u = 2^-24) of the
        # terms added per step: 4u per step relative to the terms' scale (m cancels where g changes sign,
        # so near-zero elements are held to the tensor's scale, not their own)
        m_ref, v_ref = ref.state[q]["exp_avg"], ref.state[q]["exp_avg_sq"]
        tol = steps * 4 * 2**-24
        torch.testing.assert_close(st.exp_avg, m_ref, rtol=tol, atol=tol * float(m_ref.abs().max()))
        torch.testing.assert_close(st.exp_avg_sq, v_ref, rtol=tol, atol=tol * float(v_ref.abs().max()))
        # an update is at most lr here ((1 - beta1) < sqrt(1 - beta2): Adam's bound), so each step's
        # differs by a few roundings of lr; the master's own last bit may round the other way each step
        torch.testing.assert_close(st.master, q.detach(), rtol=steps * 2**-23, atol=steps * 8 * 2**-24 * hyper.lr)
        assert_bitwise(weights[p], round_to(st.master, weights[p].dtype), f"{piece_label(p)}: one rounding")
    assert opt.step_count == steps and record.step == steps


def test_update_bytes_do_not_depend_on_length_or_offset():
    gen = torch.Generator().manual_seed(31)
    n = 1000
    w = torch.randn(n, generator=gen)
    whole, sliced = PieceState.init(w), PieceState.init(w)
    w_whole, w_sliced = w.to(torch.bfloat16), w.to(torch.bfloat16)
    cuts = [0, 1, 8, 9, 17, 100, 513, 999, n]  # odd offsets and lengths: vector bodies and scalar tails
    hyper = AdamWHyper(lr=3e-3, weight_decay=0.05)
    for t in range(1, 4):
        g = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
        coef = torch.tensor(0.625, dtype=torch.float32)
        s = step_scalars(hyper, 0.9**t, 0.999**t, torch.device("cpu"))
        adamw_update(whole.master, whole.exp_avg, whole.exp_avg_sq, g, coef, s, w_whole)
        for lo, hi in itertools.pairwise(cuts):
            st = [x[lo:hi] for x in (sliced.master, sliced.exp_avg, sliced.exp_avg_sq)]
            adamw_update(*st, g[lo:hi], coef, s, w_sliced[lo:hi])
        for field in ("master", "exp_avg", "exp_avg_sq"):
            assert_bitwise(getattr(sliced, field), getattr(whole, field), f"step {t} {field}")
        assert_bitwise(w_sliced, w_whole, f"step {t} weight")


@pytest.fixture(scope="module")
def canonical_run():
    """The single process: 3 steps (the first clipped) from fresh random gradients each step."""
    hyper = AdamWHyper(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0)
    weights = _weights()
    grads = [random_grads(weights, CONFIG, seed=200 + t, scale=1e-1 if t == 0 else 1e-3) for t in range(3)]
    opt = AdamW(weights, config=CONFIG, comm=LocalComm(), hyper=hyper, backend=BE)
    records = [opt.step(g) for g in grads]
    assert float(records[0].clip_coef) < 1.0 and float(records[1].clip_coef) == 1.0
    names = opt.named_weights()  # the runner's names, as block{i}.dw.<grad>@u{u} names the gradients
    assert names["block1.w.ff.gate@u7"] is opt.weights[Piece(1, "ff.gate", 7)]
    assert names["block0.w.norm1.weight"] is opt.weights[Piece(0, "norm1.weight", None)]
    assert names["w.proj_in.weight"] is opt.weights[Piece(None, "proj_in.weight", None)]
    return hyper, grads, opt, records


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_step_is_bitwise_for_every_tp_split(canonical_run, tp):
    hyper, grads, canon, canon_records = canonical_run

    def rank(r, comm):
        opt = AdamW(_weights(comm.units), config=CONFIG, comm=comm, hyper=hyper, backend=BE)
        return opt, [opt.step(for_units(g, comm.units)) for g in grads]

    held = set()
    for r, (opt, records) in enumerate(run_ranks(tp, rank)):
        for rec, want in zip(records, canon_records, strict=True):
            assert_bitwise(rec.grad_norm, want.grad_norm, f"tp{tp} rank {r} step {rec.step} norm")
            assert_bitwise(rec.clip_coef, want.clip_coef, f"tp{tp} rank {r} step {rec.step} coef")
        for p, w in opt.weights.items():  # replicated and non-block pieces on every rank, unit pieces once
            what = f"tp{tp} rank {r} {piece_label(p, 'w')}"
            assert_bitwise(w, canon.weights[p], what)
            assert_bitwise(opt.state[p].master, canon.state[p].master, what + " master")
            assert_bitwise(opt.state[p].exp_avg_sq, canon.state[p].exp_avg_sq, what + " exp_avg_sq")
            held.add(p)
    assert held == set(canon.weights)


def test_block_step_gradients_are_the_weights_pieces(tiny, tiny_weights):
    from h3lab.batch import packed_batch
    from h3lab.block import block_step

    step = block_step(unit_weights(tiny_weights), packed_batch(tiny, 24, seed=13), LocalComm(), backend=BE)
    grads = block_grad_pieces(3, step.dw_units, step.dw_replicated)
    weights = block_weight_pieces(3, unit_weights(tiny_weights))
    assert grads.keys() == weights.keys()
    assert all(grads[p].shape == w.shape and grads[p].dtype == w.dtype for p, w in weights.items())


@pytest.mark.parametrize(
    ("piece", "value", "match"),
    [
        (Piece(1, "ff.gate", 5), math.nan, r"\['block1\.dw\.ff\.gate@u5'\]"),
        (Piece(None, "proj_out.weight", None), -math.inf, r"\['dw\.proj_out\.weight'\]"),
        (Piece(None, "proj_in.weight", None), 3e19, r"\['dw\.proj_in\.weight'\]"),  # finite; its square overflows
    ],
)
def test_nonfinite_gradient_refuses_the_step_on_every_rank(piece, value, match):
    hyper = AdamWHyper(lr=1e-3)
    full = _weights()
    grads = random_grads(full, CONFIG, seed=300, scale=1e-2)
    grads[piece] = grads[piece].clone()
    grads[piece].view(-1)[7] = value

    def rank(r, comm):
        opt = AdamW(_weights(comm.units), config=CONFIG, comm=comm, hyper=hyper, backend=BE)
        opt.step(for_units(random_grads(full, CONFIG, seed=301, scale=1e-2), comm.units))  # a good step first
        before = {
            p: (w.clone(), opt.state[p].master.clone(), opt.state[p].exp_avg.clone()) for p, w in opt.weights.items()
        }
        with pytest.raises(NonFiniteGradError, match=f"step 2: gradient norm .*{match}.*step refused"):
            opt.step(for_units(grads, comm.units))
        for p, (w, master, m) in before.items():
            assert_bitwise(opt.weights[p], w, piece_label(p))
            assert_bitwise(opt.state[p].master, master, piece_label(p))
            assert_bitwise(opt.state[p].exp_avg, m, piece_label(p))
        return opt.step_count

    assert run_ranks(2, rank) == [1, 1]


def test_an_update_that_leaves_a_non_finite_weight_names_the_step_and_the_pieces():
    """Finite gradients, a finite norm, and an update that overflows one piece: weight decay scales its
    large weights past FP32 (lr * weight_decay = 1e10) in step 2, while every other piece stays finite.
    Before, the next step failed inside its forward, naming neither the step nor a weight."""
    weights = _weights()
    weights[Piece(1, "ff.gate", 5)].mul_(1e20)
    hyper = AdamWHyper(lr=1e8, weight_decay=100.0, max_grad_norm=math.inf)
    opt = AdamW(weights, config=CONFIG, comm=LocalComm(), hyper=hyper, backend=BE)
    opt.step(random_grads(_weights(), CONFIG, seed=302, scale=1e-2))  # step 1: 1e20 * 1e10 still fits FP32
    match = r"^step 2: the update left NaN or Inf in \['block1\.w\.ff\.gate@u5'\] \(lr 1e\+08\); the weights hold"
    with pytest.raises(NonFiniteWeightError, match=match):
        opt.step(random_grads(_weights(), CONFIG, seed=303, scale=1e-2))
    assert all(math.isfinite(m) for p, m in opt.largest_weights().items() if p != Piece(1, "ff.gate", 5))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1e-3}, r"lr -0\.001 not allowed; allowed: a finite number >= 0"),
        ({"lr": math.inf}, r"lr inf not allowed; allowed: a finite number >= 0"),
        ({"lr": "1e-3"}, r"lr '1e-3' not allowed"),
        ({"betas": (0.9,)}, r"betas \(0\.9,\) not allowed; allowed: two numbers in \[0, 1\)"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\] 1\.0 not allowed; allowed: a number in \[0, 1\)"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\] -0\.1 not allowed; allowed: a number in \[0, 1\)"),
        ({"betas": (0.9, math.nan)}, r"betas\[1\] nan not allowed"),
        ({"eps": 0.0}, r"eps 0\.0 not allowed; allowed: a finite number > 0"),
        ({"weight_decay": -0.1}, r"weight_decay -0\.1 not allowed; allowed: a finite number >= 0"),
        ({"weight_decay": True}, r"weight_decay True not allowed"),
        ({"max_grad_norm": 0}, r"max_grad_norm 0 not allowed; allowed: a number in \(0, inf\]"),
        ({"max_grad_norm": math.nan}, r"max_grad_norm nan not allowed"),
    ],
)
def test_bad_hyperparameters_name_the_value_and_the_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamWHyper(**kwargs)


def test_gradients_must_match_the_weights():
    weights = _weights(range(4, 8))
    opt = AdamW(weights, config=CONFIG, comm=_Fixed(range(4, 8)), hyper=AdamWHyper(), backend=BE)
    grads = for_units(random_grads(_weights(), CONFIG, seed=400, scale=1e-2), range(4, 8))
    with pytest.raises(ValueError, match=r"gradients: missing \['block0\.attn\.to_q\.weight@u4'\], unexpected \[\]"):
        opt.step({p: g for p, g in grads.items() if p != Piece(0, "attn.to_q.weight", 4)})
    bad = grads | {Piece(None, "proj_in.weight", None): torch.zeros(3, 3)}
    with pytest.raises(
        ValueError, match=r"gradient proj_in\.weight: \[3, 3\] torch\.float32 on cpu; allowed: \[36, 16\]"
    ):
        opt.step(bad)
    with pytest.raises(
        ValueError, match=r"pieces for units \[0, 1, 2, 3\]: missing .*unexpected \['block0\.attn\.to_q\.weight@u4',"
    ):
        AdamW(weights, config=CONFIG, comm=_Fixed(range(4)), hyper=AdamWHyper(), backend=BE)
    assert opt.step_count == 0


class _Fixed(LocalComm):
    """A rank's units without peers: for argument checks that fail before any gather."""

    def __init__(self, units: range) -> None:
        self.units = units
