"""`h3lab.parallelize` in one process: diffusers' model made deterministic in place, its forward and
autograd against diffusers' own model in float32, h3lab's objective through it giving the bytes of
`h3lab run --train-steps`, gradient accumulation, `h3lab.optim`, `full_state_dict`, and every refusal.
(Layouts on several processes: tests/test_compare.py.)

Parity metric: max_rel = max|ours - diffusers| / max|diffusers| per tensor. Both sides are float32
(unit roundoff 6e-8) in different summation orders: BLAS and SDPA against h3lab's k-ascending and
key-ordered chains and unit trees, over K up to the widths of these configs (<= 512 columns, 96 rows):
a few dozen roundoffs of growth. Measured over tiny (seed 0) and h16x24 (seed 1), with the custom
loss below: the output's max_rel <= 8.2e-7, every gradient's <= 1.9e-6 (a refiner norm weight, whose
gradient sums over every text row and channel). Bound 1e-5: >= 5x headroom; one bf16 rounding anywhere
(unit roundoff 4e-3) or a wrong formula misses it by orders of magnitude.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import h3lab
import h3lab.nn.function
import h3lab.optim as optim
from h3lab.backend import get_backend
from h3lab.config import model_param_shapes
from h3lab.model import model_inputs, shuffle_rows
from h3lab.nn import diffusers_kwargs, flow_matching_loss, full_state_dict, parallelize
from h3lab.parallel.layout import Layout
from h3lab.reference.eager_train import depth_state
from h3lab.reference.parity import model_velocity
from h3lab.run import tasks
from h3lab.run.problem import Problem
from h3lab.train.objective import FlowObjective
from h3lab.train.step import step_seed
from tests.conftest import MODEL_CONFIGS, REQUEST_CHECKS, assert_bitwise, model_in_dtype, random_diffusers_model
from tests.train_ranks import NARROW

RTOL = 1e-5
ONE = NARROW.replace(num_layers=1)  # the model of the refusals, the optimizer and the accumulation: cheap


def my_loss(video, audio, target_v, target_a, advantage):
    """Not h3lab's objective: an advantage-weighted, clamped MSE of the video head plus a cosine term on
    the audio head."""
    mse = ((video - target_v) ** 2).mean(-1)
    cos = F.cosine_similarity(audio, target_a, dim=-1)
    return (advantage * mse.clamp(max=4.0)).mean() + 0.5 * (1 - cos).clamp(min=0.05).mean()


def _targets(inputs, seed: int):
    g = torch.Generator().manual_seed(seed)
    tv, ta = torch.randn(inputs.video_rows.shape, generator=g), torch.randn(inputs.audio_rows.shape, generator=g)
    return tv, ta, torch.randn(inputs.video_rows.shape[0], generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(autouse=True)
def _strict_flags():
    """Every test leaves torch's TF32 and reduced-precision flags as it found them."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    yield
    m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


# ---- float32 against diffusers + autograd ------------------------------------------------------------
@pytest.mark.parametrize(("name", "seed"), [("tiny", 0), ("h16x24", 1)])
def test_output_and_every_gradient_match_diffusers_autograd_in_float32(name, seed):
    config = MODEL_CONFIGS[name]
    ref = model_in_dtype(random_diffusers_model(config, seed), torch.float32)
    ours = parallelize(copy.deepcopy(ref), "tp1")
    inputs = model_inputs(config, seed=100 + seed)
    tv, ta, adv = _targets(inputs, seed)
    video, audio = model_velocity(ref, inputs)
    my_loss(video, audio, tv, ta, adv).backward()
    out = ours(**diffusers_kwargs(inputs))
    assert type(out).__name__ == "MiniMaxH3TransformerOutput" and out.sample.shape == (1, *video.shape)
    my_loss(out.sample[0], out.audio_sample[0], tv, ta, adv).backward()
    assert _rel(out.sample[0].detach(), video.detach()) <= RTOL
    assert _rel(out.audio_sample[0].detach(), audio.detach()) <= RTOL
    reference = dict(ref.named_parameters())
    got = dict(ours.named_parameters())
    assert got.keys() == reference.keys() == set(model_param_shapes(config))
    for k, p in got.items():
        assert p.grad.dtype == torch.float32 and p.grad.shape == reference[k].shape, k
        assert _rel(p.grad, reference[k].grad) <= RTOL, f"{name} {k}: max_rel {_rel(p.grad, reference[k].grad):.3g}"


# ---- h3lab's own objective: the bytes of `h3lab run --train-steps` -------------------------------------
def test_h3labs_objective_as_the_users_loss_gives_the_bytes_of_the_training_run():
    """Two steps of h3lab.optim on flow_matching_loss, the rows out of key order (named by logical_keys):
    the loss, the norm and every weight after each step equal `h3lab run --train-steps`' canonical
    process's (h3lab.run.tasks.canonical: the single process every layout of the run is checked against)."""
    p = Problem(task="train", last_block=0, text_rows=7, row_order="shuffled", seed=23, lr=3e-4, weight_decay=0.05)
    canon = tasks.canonical(p, torch.device("cpu"), get_backend("torch")).tensors
    config = p.config()
    with torch.device("meta"):
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

        model = MiniMaxH3Transformer3DModel(**config.to_dict())
    model.load_state_dict(depth_state(p.model_weights(), p.block_range), strict=True, assign=True)
    model.rope = type(model.rope)(config.rope_freq_dim, config.rope_theta)  # a computed buffer
    model = h3lab.parallelize(model, "tp1")
    opt = optim.AdamW(model.parameters(), lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    objective, inputs = FlowObjective(), p.model_inputs()
    keys = inputs.logical_keys[:, 1]
    assert not bool((keys[1:] > keys[:-1]).all())  # out of key order
    for k in (1, 2):
        sample = objective.sample(inputs, step_seed(p.seed, k))
        out = model(**diffusers_kwargs(sample.inputs, keys=True))
        loss = flow_matching_loss(objective, sample, out.sample[0], out.audio_sample[0])
        loss.backward()
        norm = optim.clip_grad_norm_(model, p.max_grad_norm)
        opt.step()
        opt.zero_grad()
        assert_bitwise(loss.detach(), canon[f"step{k}.loss"], "loss")
        assert_bitwise(norm, canon[f"step{k}.grad_norm"], "grad_norm")
        assert float(canon[f"step{k}.clip_coef"]) < 1  # the clip ran
        for name, w in full_state_dict(model).items():
            block, _, rest = name.removeprefix("transformer_blocks.").partition(".")
            run_name = (
                f"step{k}.block{block}.w.{rest}" if name.startswith("transformer_blocks.") else f"step{k}.w.{name}"
            )
            assert_bitwise(w, canon[run_name], run_name)


# ---- forward without grad, gradient accumulation ---------------------------------------------------------
@pytest.fixture(scope="module")
def one_block():
    """A bf16 model of one block and a request, with the parallelized model's output and gradients for it."""
    inputs = shuffle_rows(model_inputs(ONE, seed=3, num_text=5), 4)
    model = parallelize(random_diffusers_model(ONE, 2), "tp1")
    return model, inputs, _targets(inputs, 5)


def _grads(model, inputs, targets) -> dict[str, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    out = model(**diffusers_kwargs(inputs))
    my_loss(out.sample[0], out.audio_sample[0], *targets).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_no_grad_keeps_nothing_for_a_backward_and_gives_the_same_bytes(one_block, monkeypatch):
    model, inputs, _ = one_block
    with_grad = model(**diffusers_kwargs(inputs), return_dict=False)
    node = with_grad[0].grad_fn.next_functions[0][0]  # the Function's backward node: its ctx
    kept = weakref.ref(node.fwd)  # the forward's record: each block's input rows
    video, audio = (t.detach()[0] for t in with_grad)
    del with_grad, node
    gc.collect()
    assert kept() is None  # it goes with its graph

    def no_record(*args, **kwargs):
        raise AssertionError("a forward without grad kept a record for a backward")

    monkeypatch.setattr(h3lab.nn.function, "model_forward", no_record)
    with torch.no_grad():
        plain = model(**diffusers_kwargs(inputs))
    assert plain.sample.grad_fn is None
    assert_bitwise(plain.sample[0], video, "video"), assert_bitwise(plain.audio_sample[0], audio, "audio")


def test_two_backwards_add_into_grad_in_call_order(one_block):
    model, inputs, targets = one_block
    other = shuffle_rows(model_inputs(ONE, seed=9, num_text=5), 10)
    other_targets = _targets(other, 11)
    g1, g2 = _grads(model, inputs, targets), _grads(model, other, other_targets)
    for p in model.parameters():
        p.grad = None
    for i, t in ((inputs, targets), (other, other_targets)):
        out = model(**diffusers_kwargs(i))
        my_loss(out.sample[0], out.audio_sample[0], *t).backward()
    for n, p in model.named_parameters():
        assert p.grad.dtype == p.dtype
        assert_bitwise(p.grad, g1[n] + g2[n], n)  # torch's elementwise add, one rounding per backward


def test_a_second_backward_through_one_forward_is_refused(one_block):
    model, inputs, targets = one_block
    out = model(**diffusers_kwargs(inputs))
    loss = my_loss(out.sample[0], out.audio_sample[0], *targets)
    loss.backward(retain_graph=True)
    with pytest.raises(ValueError, match="a second backward through one forward; allowed: one backward per forward"):
        loss.backward()


# ---- h3lab.optim --------------------------------------------------------------------------------------
def test_the_optimizer_state_round_trips_and_param_groups_keep_their_hyperparameters():
    """Two groups (the block at lr 1e-2, the rest at 1e-3). Step 1, the state dict saved; step 2. Then the
    weights of after step 1 restored, the same gradients, the saved state loaded into a fresh optimizer:
    its step 2 gives the bytes of the optimizer that went on."""
    model = parallelize(random_diffusers_model(ONE, 7), "tp1")
    inputs = model_inputs(ONE, seed=8, num_text=5)
    targets = _targets(inputs, 1)
    named = dict(model.named_parameters())

    def groups() -> list[dict]:
        block = [p for n, p in named.items() if n.startswith("transformer_blocks.")]
        rest = [p for n, p in named.items() if not n.startswith("transformer_blocks.")]
        return [{"params": block, "lr": 1e-2}, {"params": rest}]

    opt = optim.AdamW(groups(), lr=1e-3, weight_decay=0.1)
    _grads(model, inputs, targets)
    optim.clip_grad_norm_(model, 0.5)
    opt.step()
    saved, weights = copy.deepcopy(opt.state_dict()), {n: p.detach().clone() for n, p in named.items()}
    grads = _grads(model, inputs, targets)
    optim.clip_grad_norm_(model, 0.5)
    opt.step()
    after = {n: p.detach().clone() for n, p in named.items()}
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(weights[n])
            p.grad = grads[n].clone()
    fresh = optim.AdamW(groups(), lr=1e-3, weight_decay=0.1)
    fresh.load_state_dict(saved)
    assert all(fresh.state[p]["master"].dtype == torch.float32 for p in named.values())
    assert [g["lr"] for g in fresh.param_groups] == [1e-2, 1e-3]
    optim.clip_grad_norm_(model, 0.5)
    fresh.step()
    for n, p in named.items():
        assert_bitwise(p.detach(), after[n], n)
    assert not torch.equal(after["transformer_blocks.0.norm1.weight"], weights["transformer_blocks.0.norm1.weight"])


def test_clip_refusals_keep_a_coefficient_from_being_lost_or_misapplied(one_block):
    model, inputs, targets = one_block
    opt = optim.AdamW(model.parameters())
    _grads(model, inputs, targets)
    optim.clip_grad_norm_(model, 1.0)
    with pytest.raises(ValueError, match=r"clip_grad_norm_'s coefficient was never applied; allowed: .*AdamW.step"):
        model(**diffusers_kwargs(inputs))
    next(model.parameters()).grad.mul_(2)  # a gradient changed after the norm
    with pytest.raises(ValueError, match=r"gradients changed after clip_grad_norm_ \(\['proj_in.weight'\]\)"):
        opt.step()
    opt.zero_grad()  # drops the coefficient: the step it was for is skipped
    model(**diffusers_kwargs(inputs))
    with pytest.raises(ValueError, match=r"max_norm 0; allowed: a number in \(0, inf\]"):
        optim.clip_grad_norm_(model, 0)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 belongs to no parallelized model"):
        optim.AdamW(nn.Linear(2, 2).parameters())


def test_a_refused_gradient_changes_no_weight_and_no_state(one_block):
    """The last parameter's gradient has another shape (set behind autograd's checks): the step is
    refused before any update, so every weight and every state (its step count included) stays as
    the step before left it."""
    model, inputs, targets = one_block
    opt = optim.AdamW(model.parameters())
    _grads(model, inputs, targets)
    opt.step()
    params = list(model.parameters())
    weights = [p.detach().clone() for p in params]
    state = copy.deepcopy({i: opt.state[p] for i, p in enumerate(params)})
    _grads(model, inputs, targets)
    params[-1].grad.data = torch.zeros(3, dtype=params[-1].dtype)
    with pytest.raises(ValueError, match=r"gradient \[3\] .*; allowed: "):
        opt.step()
    for i, p in enumerate(params):
        assert_bitwise(p.detach(), weights[i], f"weight {i}")
        assert opt.state[p]["step"] == state[i]["step"] == 1, i
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert_bitwise(opt.state[p][k], state[i][k], f"parameter {i} {k}")


# ---- full_state_dict -----------------------------------------------------------------------------------
def test_full_state_dict_loads_into_a_plain_diffusers_model(one_block):
    model = one_block[0]
    plain = random_diffusers_model(ONE, 99)
    full = full_state_dict(model)
    assert list(full) == [n for n, _ in plain.named_parameters()]
    plain.load_state_dict(full)
    for n, p in plain.named_parameters():
        assert_bitwise(p.detach(), dict(model.named_parameters())[n].detach(), n)


# ---- refusals: one line naming the value and the allowed set ----------------------------------------------
def _model(seed: int = 0):
    return random_diffusers_model(ONE, seed)


def test_a_model_that_is_not_minimax_h3_is_refused():
    with pytest.raises(ValueError, match=r"model is a Linear; allowed: diffusers' MiniMaxH3Transformer3DModel"):
        parallelize(nn.Linear(2, 2), "tp1")


def test_a_world_size_or_a_mesh_that_does_not_match_the_layout_is_refused():
    from torch.distributed.device_mesh import DeviceMesh

    with pytest.raises(ValueError, match=r"world size 1 for layout tp2; allowed: 2 ranks"):
        parallelize(_model(), "tp2")
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("cp", "tp"), _init_backend=False, _rank=0)
    with pytest.raises(ValueError, match=r"mesh \(cp=2, tp=2\) has TP groups \[\(0, 1\), \(2, 3\)\] but layout tp4"):
        parallelize(_model(), "tp4", mesh=mesh)
    wrong = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp",), _init_backend=False, _rank=0)
    with pytest.raises(ValueError, match=r"mesh dims \('dp',\); allowed: a DeviceMesh with dims named 'tp' and 'cp'"):
        parallelize(_model(), "tp2", mesh=wrong)
    from h3lab.nn.apply import check_mesh

    check_mesh(Layout.parse("tp2xcp2"), mesh)  # the layout it lays out: no refusal


def test_parameters_on_another_device_are_refused():
    model = _model()
    model.proj_in.bias = nn.Parameter(model.proj_in.bias.to("meta"))
    with pytest.raises(ValueError, match=r"parameters and buffers on \['cpu', 'meta'\]; allowed: one device"):
        parallelize(model, "tp1")
    with pytest.raises(ValueError, match=r"parameters on meta; allowed: \['cpu', 'cuda'\]"):
        parallelize(_model().to("meta"), "tp1")
    model = parallelize(_model(), "tp1")
    kwargs = diffusers_kwargs(model_inputs(ONE, seed=1, num_text=5))
    kwargs["hidden_states"] = kwargs["hidden_states"].to("meta")
    with pytest.raises(ValueError, match=r"hidden_states on meta; allowed: cpu \(the model's device\)"):
        model(**kwargs)


class _LoraLinear(nn.Module):
    """PEFT's LoRA layer as it sits in a model (base_layer, lora_A, lora_B): peft itself is not installed."""

    def __init__(self, base: nn.Linear, r: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})


def test_peft_lora_adapters_on_the_blocks_are_refused_as_not_supported_yet():
    model = _model()
    model.transformer_blocks[0].attn.to_q = _LoraLinear(model.transformer_blocks[0].attn.to_q)
    with pytest.raises(ValueError, match=r"model carries PEFT/LoRA adapters; not supported yet; allowed: a model"):
        parallelize(model, "tp1")


def test_a_second_parallelize_is_refused():
    model = parallelize(_model(), "tp1")
    with pytest.raises(
        ValueError, match=r"model is parallelized already \(layout tp1\); allowed: one h3lab.parallelize"
    ):
        parallelize(model, "tp1")


def test_tf32_or_reduced_precision_reductions_switched_on_are_refused(one_block):
    m = torch.backends.cuda.matmul
    m.allow_tf32 = True
    with pytest.raises(ValueError, match=r"allow_tf32 is True; allowed: False \(no TF32\)"):
        parallelize(_model(), "tp1")
    m.allow_tf32 = False
    model, inputs, targets = one_block
    assert not m.allow_bf16_reduced_precision_reduction  # parallelize switched them off
    m.allow_bf16_reduced_precision_reduction = True
    with pytest.raises(ValueError, match=r"allow_bf16_reduced_precision_reduction is True; allowed: False"):
        model(**diffusers_kwargs(inputs))
    m.allow_bf16_reduced_precision_reduction = False
    out = model(**diffusers_kwargs(inputs))
    m.allow_fp16_reduced_precision_reduction = True  # switched on between the forward and the backward
    with pytest.raises(ValueError, match=r"allow_fp16_reduced_precision_reduction is True; allowed: False"):
        my_loss(out.sample[0], out.audio_sample[0], *targets).backward()


def test_bad_forward_arguments_are_refused(one_block):
    model, inputs, _ = one_block
    kwargs = diffusers_kwargs(inputs)
    two = kwargs | {"hidden_states": kwargs["hidden_states"].expand(2, -1, -1)}
    with pytest.raises(ValueError, match=r"hidden_states: shape \[2, 72, 16\]; allowed: \[1, rows, channels\]"):
        model(**two)
    with pytest.raises(ValueError, match=r"attention_kwargs=\{'scale': 0.5\}; allowed: None"):
        model(**kwargs, attention_kwargs={"scale": 0.5})
    grad_in = kwargs | {"hidden_states": kwargs["hidden_states"].clone().requires_grad_()}
    with pytest.raises(ValueError, match=r"hidden_states requires grad; allowed: inputs without gradients"):
        model(**grad_in)


# ---- a request's values checked once --------------------------------------------------------------------
def _fields(inputs) -> dict:
    return {k: (v.dtype, v.tolist()) if isinstance(v, torch.Tensor) else v for k, v in vars(inputs).items()}


@pytest.mark.parametrize("keys", [False, True])
def test_a_handed_out_request_is_read_as_it_is_without_a_host_sync(keys):
    """The tensors `diffusers_kwargs` handed out give the request a fresh check would make, field for field,
    with no host sync (the request checked its values when it was made); copies of them are checked."""
    from h3lab.bench.host_syncs import host_syncs
    from h3lab.nn.inputs import model_inputs_of

    inputs = shuffle_rows(model_inputs(ONE, seed=3, num_text=5), 4)
    kwargs = diffusers_kwargs(inputs, keys=keys)
    keys_in = kwargs.pop("logical_keys", None)
    cpu = torch.device("cpu")
    handed = []
    syncs = host_syncs(lambda: handed.append(model_inputs_of(kwargs, cpu, keys_in)), cpu)
    copies = {k: v.clone() for k, v in kwargs.items()}
    checked = []
    fresh = host_syncs(
        lambda: checked.append(model_inputs_of(copies, cpu, None if keys_in is None else keys_in.clone())), cpu
    )
    assert syncs["total"] == 0 and fresh["sites"].keys() >= REQUEST_CHECKS
    assert _fields(handed[0]) == _fields(checked[0])  # the same fields: no state of its own beside them
    assert inputs.num_condition_video_rows > 0 and handed[0].num_condition_video_rows == 0  # as any forward's


def test_a_handed_out_tensor_written_in_place_is_checked_again(one_block):
    model, inputs, _ = one_block
    kwargs = diffusers_kwargs(inputs.replace(video_rows=inputs.video_rows.clone()))
    kwargs["hidden_states"][0, 0, 0] = float("nan")  # the version counter moves
    with pytest.raises(ValueError, match=r"video_rows: holds inf or NaN"):
        model(**kwargs)
    keys = inputs.logical_keys.clone()
    keys[1] = keys[0]
    with pytest.raises(ValueError, match=r"logical_keys: keys must be unique"):
        model(**diffusers_kwargs(inputs), logical_keys=keys)  # other keys than the request's: checked


# ---- what a script reports to h3lab compare ------------------------------------------------------------
def test_current_layout_and_record_outside_and_inside_a_session(monkeypatch):
    from h3lab.nn import recording as rec
    from h3lab.run.progress import Progress

    monkeypatch.delenv("H3LAB_LAYOUT", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert h3lab.current_layout() == Layout.parse("tp1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ValueError, match=r"H3LAB_LAYOUT is not set in a world of 4 ranks; allowed: a script run by h3lab"
    ):
        h3lab.current_layout()
    monkeypatch.setenv("H3LAB_LAYOUT", "tp2xcp2")
    assert h3lab.current_layout() == Layout.parse("tp2xcp2")
    x = torch.randn(3)
    assert rec.session() is None and h3lab.record("x", x) is None  # outside h3lab compare: nothing
    session = rec.start_session(Progress(None).tick)
    try:
        h3lab.record("x", x)
        with pytest.raises(ValueError, match=r"record 'x' recorded twice; allowed: each name once per run"):
            h3lab.record("x", x)
        with pytest.raises(ValueError, match=r"record 'n': torch.int64; allowed: a floating-point tensor"):
            h3lab.record("n", torch.arange(3))
        x.add_(1)  # the record is a copy, taken when recorded
        assert session.recorder.entries == [{"name": "x", "space": "replicated", "param": None}]
        assert torch.equal(session.recorder.tensors["x"] + 1, x)
    finally:
        rec.end_session()
