"""Golden digests: this CPU reproduces the device-independent set, and the choice of set, the
provenance lines, the unpublished case and recording work for every node type, decided on the CPU.

Where a GPU node is played (an H100, an H200, a B200), its node type and architecture are
monkeypatched and its digests are given: either the published ones (to check the decisions, not
the bits) or this CPU's torch digests, which a GPU's torch backend must give too.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from h3lab.cli import main
from h3lab.cli.verify import UNPUBLISHED
from h3lab.run import golden

PUBLISHED = {p.stem: json.loads(p.read_text()) for p in golden.GOLDEN_DIR.glob("*.json")}
TRAIN = len(PUBLISHED["torch"]["train"])  # the training gate's tensors: 2 steps x (scalars, dW, weights)


@pytest.fixture(scope="module")
def cpu_torch() -> dict[str, dict[str, str]]:
    """This CPU's torch digests of the reference block, trajectory and training gate, computed once."""
    return golden.compute("torch", "cpu", list(golden.CPU_PARTS))


@pytest.fixture
def sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the published sets that records may change."""
    for p in golden.GOLDEN_DIR.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path)
    return tmp_path


def play_gpu(monkeypatch: pytest.MonkeyPatch, node: str, arch: str, digests: dict[str, dict[str, dict[str, str]]]):
    """Make this CPU answer as a CUDA device of `node` and `arch` whose backends give `digests`."""
    env = golden.capture("cpu") | {"gpus": [{"name": f"NVIDIA {node}", "capability": arch}]}
    monkeypatch.setattr(golden, "node_type", lambda device=None: node if torch.device(device).type == "cuda" else "CPU")
    monkeypatch.setattr(golden, "arch_of", lambda device: arch)
    monkeypatch.setattr(golden, "capture", lambda device=None: env)
    monkeypatch.setattr(golden, "compute", lambda backend, device, parts: {p: dict(digests[backend][p]) for p in parts})


def flipped(digests: dict[str, dict[str, str]], part: str, tensor: str) -> dict[str, dict[str, str]]:
    out = {p: dict(d) for p, d in digests.items()}
    out[part][tensor] = "0" * 64
    return out


def test_this_cpu_reproduces_the_torch_set(capsys):
    assert main(["verify"]) == 0
    out = capsys.readouterr().out
    assert "recorded on CPU; observed on CPU (block, trajectory, train), H200 (block, trajectory, train)" in out
    assert "expected, not yet observed on: H100, B200" in out
    assert f"ok   {'out':32s} {PUBLISHED['torch']['block']['out'][:16]}" in out
    assert "CPU / torch: reproduces the published bits of set torch" in out


def test_verify_names_every_tensor_of_the_set_in_its_recorded_order(monkeypatch, cpu_torch):
    monkeypatch.setattr(golden, "compute", lambda backend, device, parts: {p: cpu_torch[p] for p in parts})
    res = golden.verify("torch", "cpu")
    assert res["set"] == "torch" and res["node_type"] == "CPU" and res["status"] == "match" and res["match"]
    assert list(res["tensors"])[:3] == ["out", "dx", "dtemb"] and len(res["tensors"]) == 15 + 6 + TRAIN
    assert list(res["tensors"])[15] == "trajectory.step0.video" and list(res["tensors"])[21] == "train.step1.loss"
    assert res["recorded_on"] == "CPU" and res["not_observed"] == [] and res["first_mismatch"] is None


def test_a_different_problem_is_named_at_its_first_differing_tensor(monkeypatch, capsys):
    monkeypatch.setattr(golden, "REFERENCE", replace(golden.REFERENCE, seed=1))  # other packed rows
    assert main(["verify"]) == 1
    out = capsys.readouterr().out
    assert f"DIFF {'out':32s}" in out and f"ok   {'trajectory.step0.video':32s}" in out
    assert "CPU / torch: DOES NOT reproduce set torch; first differing tensor: out" in out


def test_backends_outside_the_contract_and_triton_on_a_cpu_are_refused(capsys):
    allowed = r"\['torch', 'triton', 'emulate-sm90'\]"
    with pytest.raises(ValueError, match=rf"no golden digest sets for backend 'baseline'; allowed: {allowed}"):
        golden.verify("baseline", "cpu")
    assert main(["verify", "--backend", "triton"]) == 2
    assert "backend 'triton' needs a CUDA device, got cpu; allowed on cpu: torch" in capsys.readouterr().err


def test_the_set_follows_the_backend_and_the_architecture(monkeypatch):
    for capability, arch in (((9, 0), "sm90"), ((10, 0), "sm100"), ((8, 0), "sm80")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert golden.set_name("triton", "cuda") == arch
        assert golden.set_name("torch", "cuda") == "torch"  # the torch set on every device
    assert golden.scope("sm90") == ("sm90 GPUs (kernels/sm90.json)", ["H100", "H200"])
    assert golden.scope("torch")[1] == ["CPU", "H100", "H200", "B200"]


def test_an_h100_checks_triton_against_the_sm90_set_recorded_on_the_h200(monkeypatch, capsys, sets):
    sm90 = PUBLISHED["sm90"]
    play_gpu(monkeypatch, "H100", "sm90", {"triton": {p: sm90[p] for p in golden.PARTS}})
    res = golden.verify("triton", "cuda")
    assert res["set"] == "sm90" and res["match"] and res["recorded_on"] == "H200"
    assert res["not_observed"] == ["block", "trajectory", "train", "real"] and res["expected_not_observed"] == ["H100"]
    assert len(res["tensors"]) == 15 + 6 + TRAIN + len(sm90["real"])
    assert main(["verify", "--device", "cuda", "--backend", "triton"]) == 0
    out = capsys.readouterr().out
    assert "set sm90 (" in out and "recorded on H200; observed on H200 (block, trajectory, train, real)" in out
    assert "block, trajectory, train, real: expected, not yet observed on H100" in out
    assert "to add H100 to the set's observations: h3lab verify --device cuda --backend triton --record --real" in out
    # the same decision, with one tensor of the real-shape problem differing
    play_gpu(monkeypatch, "H100", "sm90", {"triton": flipped({p: sm90[p] for p in golden.PARTS}, "real", "dx")})
    assert main(["verify", "--device", "cuda", "--backend", "triton"]) == 1
    assert "H100 / triton: DOES NOT reproduce set sm90; first differing tensor: real.dx" in capsys.readouterr().out


def test_gpus_check_torch_against_the_device_independent_set(monkeypatch, capsys, sets, cpu_torch):
    play_gpu(monkeypatch, "H100", "sm90", {"torch": cpu_torch})
    assert main(["verify", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "set torch (" in out and "recorded on CPU" in out
    assert "block, trajectory, train: expected, not yet observed on H100" in out
    play_gpu(monkeypatch, "H200", "sm90", {"torch": cpu_torch})  # the H200 has reproduced every part
    res = golden.verify("torch", "cuda")
    assert res["match"] and res["not_observed"] == []


def test_a_b200_with_nothing_published_prints_its_digests_and_how_to_publish(monkeypatch, capsys, sets, cpu_torch):
    play_gpu(monkeypatch, "B200", "sm100", {"triton": cpu_torch})  # stand-in digests: the decision is tested
    res = golden.verify("triton", "cuda")
    assert res["status"] == "unpublished" and not res["match"] and res["set"] == "sm100"
    assert main(["verify", "--device", "cuda", "--backend", "triton"]) == UNPUBLISHED
    out = capsys.readouterr().out
    assert f"no golden digests published for backend triton on sm100 ({sets / 'sm100.json'} does not exist)" in out
    assert f"     {'out':32s} {cpu_torch['block']['out']}" in out  # whole digests, to compare by hand
    assert "to publish them: h3lab verify --device cuda --backend triton --record (add --real" in out
    assert not (sets / "sm100.json").exists()


def test_record_starts_a_set_and_adds_the_observations_of_equal_digests(monkeypatch, sets, cpu_torch):
    play_gpu(monkeypatch, "B200", "sm100", {"triton": cpu_torch})
    assert main(["verify", "--device", "cuda", "--backend", "triton", "--record"]) == 0
    sm100 = json.loads((sets / "sm100.json").read_text())
    assert sm100["set"] == "sm100" and sm100["backend"] == "triton" and sm100["recorded_on"] == "B200"
    assert list(sm100["observations"]) == ["B200"] and sm100["observations"]["B200"]["parts"] == list(golden.CPU_PARTS)
    assert sm100["expected_not_observed"] == [] and sm100["block"] == cpu_torch["block"]
    assert golden.verify("triton", "cuda")["match"]
    # an H100 reproducing the torch set joins its observations; nothing else in the set moves
    before = json.loads((sets / "torch.json").read_text())
    play_gpu(monkeypatch, "H100", "sm90", {"torch": cpu_torch})
    golden.record("torch", "cuda")
    after = json.loads((sets / "torch.json").read_text())
    assert list(after["observations"]) == ["CPU", "H200", "H100"] and after["expected_not_observed"] == ["B200"]
    assert after["recorded_on"] == "CPU" and after["observations"]["H200"] == before["observations"]["H200"]
    assert {k: v for k, v in after.items() if k not in ("observations", "expected_not_observed")} == {
        k: v for k, v in before.items() if k not in ("observations", "expected_not_observed")
    }


def test_record_refuses_other_digests_unless_told_to_replace_the_set(monkeypatch, capsys, sets):
    sm90 = PUBLISHED["sm90"]
    play_gpu(monkeypatch, "H100", "sm90", {"triton": flipped({p: sm90[p] for p in golden.PARTS}, "block", "dx")})
    before = (sets / "sm90.json").read_bytes()
    assert main(["verify", "--device", "cuda", "--backend", "triton", "--record"]) == 2
    err = capsys.readouterr().err
    assert "golden set 'sm90': this machine's block differ, first at dx" in err and "--record --replace" in err
    assert (sets / "sm90.json").read_bytes() == before
    assert main(["verify", "--replace"]) == 2
    # the set holds the real-shape problem: a replacement recomputes it too, never drops it
    assert main(["verify", "--device", "cuda", "--backend", "triton", "--record", "--replace"]) == 2
    assert "holds the real-shape problem" in capsys.readouterr().err
    assert (sets / "sm90.json").read_bytes() == before
    assert main(["verify", "--device", "cuda", "--backend", "triton", "--record", "--real", "--replace"]) == 0
    replaced = json.loads((sets / "sm90.json").read_text())
    assert replaced["recorded_on"] == "H100" and list(replaced["observations"]) == ["H100"]
    assert replaced["block"]["dx"] == "0" * 64 and replaced["real"] == sm90["real"]
    assert replaced["expected_not_observed"] == ["H200"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_set_says_where_it_was_observed_and_matches_the_code(name):
    s = PUBLISHED[name]
    assert s["set"] == name and s["backend"] == ("torch" if name == "torch" else "triton")
    assert s["scope"] == golden.scope(name)[0] and s["recorded_on"] in s["observations"]
    parts = [p for p in golden.PARTS if p in s]
    assert all(set(o["parts"]) <= set(parts) for o in s["observations"].values())
    assert s["expected_not_observed"] == [n for n in golden.scope(name)[1] if n not in s["observations"]]
    stored = {golden.PROBLEM_KEYS[p]: golden.problem_record(s[golden.PROBLEM_KEYS[p]]) for p in parts}
    assert stored == golden._problems(parts)
    assert s["contract"] == golden.CONTRACT_ID


def test_a_golden_set_that_is_not_json_is_named(sets, capsys):
    (sets / "torch.json").write_text("{not json")
    assert main(["verify"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"h3lab verify: error: {sets / 'torch.json'}: not a golden set (") and len(err.splitlines()) == 1
    )


def play_emulator(monkeypatch: pytest.MonkeyPatch, digests: dict[str, dict[str, str]] | Exception) -> None:
    """Make the emulator's digests `digests` (or raise it, a missing model), without computing them."""

    def compute(backend, device, parts):
        assert backend == "emulate-sm90" and device == "cpu"
        if isinstance(digests, Exception):
            raise digests
        return {p: dict(digests[p]) for p in parts}

    monkeypatch.setattr(golden, "compute", compute)


def unemulated(sets: Path) -> None:
    """The sm90 set in `sets` as recorded on its GPU, before any emulator wrote its `emulated` field."""
    path = sets / "sm90.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "emulated"}, indent=1))


def test_the_emulator_checks_the_sm90_sets_cpu_parts_on_a_cpu(monkeypatch, capsys, sets):
    sm90 = PUBLISHED["sm90"]
    unemulated(sets)
    play_emulator(monkeypatch, sm90)
    res = golden.verify("emulate-sm90", "cpu")
    assert res["set"] == "sm90" and res["match"] and res["emulated"] == []
    assert len(res["tensors"]) == 15 + 6 + TRAIN and res["not_observed"] == list(golden.CPU_PARTS)  # real: spot checks
    assert main(["verify", "--backend", "emulate-sm90"]) == 0
    out = capsys.readouterr().out
    assert "reproduced by emulate-sm90 before: nothing recorded" in out
    assert "to record it in the set's emulated field: h3lab verify --backend emulate-sm90 --record" in out
    with pytest.raises(ValueError, match="runs on a CPU"):
        golden.set_name("emulate-sm90", "cuda")


def test_recording_the_emulator_adds_what_it_reproduced_and_never_digests(monkeypatch, capsys, sets):
    sm90 = PUBLISHED["sm90"]
    unemulated(sets)
    play_emulator(monkeypatch, flipped({p: sm90[p] for p in golden.EMULATED_PARTS}, "trajectory", "step1.video"))
    before = (sets / "sm90.json").read_bytes()
    assert main(["verify", "--backend", "emulate-sm90", "--record"]) == 2
    assert "differs, first at trajectory.step1.video; nothing recorded" in capsys.readouterr().err
    assert (sets / "sm90.json").read_bytes() == before
    play_emulator(monkeypatch, sm90)
    assert main(["verify", "--backend", "emulate-sm90", "--record"]) == 0
    after = json.loads((sets / "sm90.json").read_text())
    assert after["emulated"]["parts"] == list(golden.CPU_PARTS) and after["emulated"]["backend"] == "emulate-sm90"
    assert {k: v for k, v in after.items() if k != "emulated"} == json.loads(before)
    assert golden.verify("emulate-sm90", "cpu")["not_observed"] == []
    for flags in (["--real"], ["--record", "--replace"], ["--device", "cuda"]):
        assert main(["verify", "--backend", "emulate-sm90", *flags]) == 2
    assert main(["verify", "--capture", str(sets)]) == 2  # spot checks are the emulator's
    with pytest.raises(ValueError, match="never writes digests"):
        golden.record("emulate-sm90", "cpu")


def test_a_missing_model_is_one_line_that_names_it(monkeypatch, capsys, sets):
    play_emulator(monkeypatch, NotImplementedError("no exact model of ex2.approx.ftz.f32 yet"))
    assert main(["verify", "--backend", "emulate-sm90"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot compute block/trajectory/train here: no exact model of ex2.approx.ftz.f32 yet" in err
    assert len(err.splitlines()) == 1


def test_a_record_into_an_installed_packages_sets_is_refused_before_any_digest(monkeypatch, tmp_path):
    installed = tmp_path / "lib" / "python3.11" / "site-packages" / "h3lab" / "kernels" / "golden"
    monkeypatch.setattr(golden, "GOLDEN_DIR", installed)
    monkeypatch.setattr(golden, "reference_digests", lambda *a: pytest.fail("digests computed before the refusal"))
    with pytest.raises(ValueError, match=r"torch\.json: an installed package's golden set, lost on reinstall; allowed"):
        golden.record("torch", "cpu")
    assert not installed.exists()
