"""Golden digests: the published bits of reference problems, one set per thing that determines them.

A set is `kernels/golden/<set>.json`, named by what fixes its bits:
- `torch`: the torch backend. It is built from correctly rounded IEEE operations (h3lab.backend),
  so its bits do not depend on the device: one set for a CPU and every GPU.
- `<arch>` (`sm90`, `sm100`): the triton backend on GPUs of one architecture, whose bits the pinned
  configurations `kernels/<arch>.json` fix: an H100 and an H200 are both sm90.

A set holds the sha256 of the canonical block's out, dx, dtemb and every dW for the reference
problem (tiny config, synthetic weights of seed 0, block 0, 264 packed rows of seed 0), of the
reference trajectory's latents, of the training gate's every tensor (two Trainer steps of blocks
0-1: losses, norms, gradients, weights), and for GPU backends of the real-shape problem; and where it came
from: `recorded_on` (the node type that wrote it), `observations` (per node type, which parts it
reproduced, when, on what software) and `expected_not_observed` (node types the set covers that
have reproduced nothing yet). Digests are recorded outputs, re-recorded only when the arithmetic
is meant to change (`record(..., replace=True)`); recording on another node type of the same set
adds its observation and refuses digests that differ.

On a GPU the tiny config (head_dim 32) does not reach the kernels' real tiles, so a backend may
also pin the real-shape problem `REAL` (real config, 520 rows of which 8 are padding: a GEMM row
tail, padding among the rows): out, dx, dtemb and every per-unit slice of every dW.

An emulated backend (h3lab.backend.EMULATED: `emulate-sm90` on a CPU) is checked against the set
of the architecture it emulates, for the parts a CPU can compute (the block, the trajectory and
the training gate; the real shapes are spot-checked from a GPU capture instead, h3lab.bench.spot_check). It never
writes digests: recording adds the set's `emulated` field (the parts the emulator reproduced,
when, on what software, and a spot check if one ran), and refuses where its digests differ.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from h3lab.backend import CONTRACT_BACKENDS, EMULATED, Backend, get_backend
from h3lab.block import canonical_block
from h3lab.contract import CONTRACT_ID
from h3lab.io.env import KNOWN_GPUS, capture, node_type
from h3lab.io.jsonfile import write_json
from h3lab.metrics import sha256_tensor
from h3lab.run.problem import Problem
from h3lab.triton.configs import KERNELS_DIR

GOLDEN_DIR = KERNELS_DIR / "golden"
REFERENCE = Problem(synthetic="tiny", weights_seed=0, block=0, rows=264, padding=0, seed=0)
# the generation gate: 2 sampler steps through the whole tiny transformer (4 blocks), seed 0, its
# weights drawn by the CPU's generator on every device (a GPU's trajectory is one a CPU can emulate)
TRAJECTORY = Problem(
    synthetic="tiny", task="trajectory", block=0, last_block=3, steps=2, seed=0, weights_generator="cpu"
)
# the training gate: 2 training steps (Trainer: forward, backward, clip, AdamW) of blocks 0-1 with the
# embedders, refiner and heads, tiny config, seed 0, weights drawn by the CPU's generator
TRAIN = Problem(synthetic="tiny", task="train", block=0, last_block=1, steps=2, seed=0, weights_generator="cpu")
# the kernels at the real H3 shapes (GPU backends)
REAL = Problem(synthetic="real", weights_seed=0, block=0, rows=520, padding=8, seed=0)
# the parts of a set, in the order verify names tensors: the reference block, the trajectory, the
# training steps, the real shapes
PARTS = ("block", "trajectory", "train", "real")
CPU_PARTS = ("block", "trajectory", "train")  # what every set holds (the real shapes: GPU sets only)
EMULATED_PARTS = CPU_PARTS  # what a CPU computes of a set by emulation (real: spot checks)
PROBLEM_KEYS = {p: f"{p}_problem" for p in PARTS}
TORCH_SET = "torch"
RECORD_FIELDS = ("torch", "triton", "cuda", "driver", "platform")


def reference_digests(be: Backend, device: str) -> dict[str, str]:
    """sha256 of every tensor of the reference problem's canonical block, in `BlockResult.tensors()` order."""
    p = replace(REFERENCE, device=device, backend=be.name)
    result = canonical_block(p.weights(device), p.batch(device), backend=be)
    return {k: sha256_tensor(v) for k, v in result.tensors().items()}


def _task_digests(problem: Problem, be: Backend, device: str) -> dict[str, str]:
    from h3lab.comm import LocalComm
    from h3lab.run import tasks

    p = replace(problem, device=device, backend=be.name)
    tensors = tasks.compute(p, LocalComm(), torch.device(device), backend=be).tensors
    return {k: sha256_tensor(v) for k, v in tensors.items()}


def trajectory_digests(be: Backend, device: str) -> dict[str, str]:
    """sha256 of the reference trajectory's latents after every step (`step{k}.video`, `step{k}.audio`)."""
    return _task_digests(TRAJECTORY, be, device)


def train_digests(be: Backend, device: str) -> dict[str, str]:
    """sha256 of the training gate's tensors after every step (`step{k}.loss`, `.grad_norm`, every dW
    and every weight after the update), in the order the Trainer returns them."""
    return _task_digests(TRAIN, be, device)


def real_digests(be: Backend, device: str) -> dict[str, str]:
    """sha256 of the real-shape problem's tensors as one process computes them: out, dx, dtemb, the
    replicated dW and every per-unit dW slice (`dw.<grad>@u<u>`), in the order the block returns them."""
    return _task_digests(REAL, be, device)


def compute(backend: str, device: str, parts: list[str]) -> dict[str, dict[str, str]]:
    """The digests of each named part (`PARTS`) computed here with the backend named `backend` on
    `device` (built once, for every part)."""
    be = get_backend(backend, device)
    by_part = {
        "block": reference_digests,
        "trajectory": trajectory_digests,
        "train": train_digests,
        "real": real_digests,
    }
    return {part: by_part[part](be, device) for part in parts}


def arch_of(device: torch.device | str) -> str:
    """The GPU architecture of a CUDA device as a set name: `sm<major><minor>` (sm90, sm100)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"backend 'triton' needs a CUDA device, got {device}; allowed on {device.type}: torch")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def set_name(backend: str, device: torch.device | str) -> str:
    """The set whose digests `backend` on `device` must give: `torch` on any device, the GPU's arch for
    triton, the emulated arch for an emulated backend (on a CPU)."""
    if backend not in CONTRACT_BACKENDS:
        raise ValueError(f"no golden digest sets for backend {backend!r}; allowed: {list(CONTRACT_BACKENDS)}")
    if backend in EMULATED:
        if torch.device(device).type != "cpu":
            raise ValueError(f"backend {backend!r} runs on a CPU, got {device}; allowed: --device cpu")
        return EMULATED[backend]
    return TORCH_SET if backend == "torch" else arch_of(device)


def scope(name: str) -> tuple[str, list[str]]:
    """(what a set covers, the known node types it covers): every device for `torch`; for an arch,
    the node types its pinned configuration file names (kernels/<arch>.json)."""
    if name == TORCH_SET:
        return "every device", ["CPU", *KNOWN_GPUS]
    pinned = KERNELS_DIR / f"{name}.json"
    nodes = json.loads(pinned.read_text()).get("node_types", []) if pinned.is_file() else []
    return f"{name} GPUs (kernels/{name}.json)", list(nodes)


def set_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def writable_set_path(name: str) -> Path:
    """`set_path(name)`; ValueError where a record must not write: an installed package's copy, which
    the next install replaces (a checkout's kernels/golden, or $H3LAB_KERNELS_DIR's, it may)."""
    path = set_path(name)
    if {"site-packages", "dist-packages"} & set(path.resolve().parts):
        raise ValueError(
            f"{path}: an installed package's golden set, lost on reinstall; allowed: a checkout's "
            "kernels/golden (run from a clone), or a folder named by H3LAB_KERNELS_DIR"
        )
    return path


def load_set(name: str) -> dict[str, Any] | None:
    """The published set `name`, or None when nothing is published for it."""
    path = set_path(name)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a golden set ({err}); allowed: the file as git holds it") from None


def flatten(digests: dict[str, dict[str, str]]) -> dict[str, str]:
    """{part: {tensor: sha}} as verify names them: the block's tensors by name, the others `<part>.<tensor>`."""
    out: dict[str, str] = {}
    for part in PARTS:
        for k, v in digests.get(part, {}).items():
            out[k if part == "block" else f"{part}.{k}"] = v
    return out


def record_command(backend: str, device: str, *, real: bool = False) -> str:
    """The command that publishes this machine's digests for `backend` on `device`."""
    flags = ("" if device == "cpu" else f" --device {device}") + ("" if backend == "torch" else f" --backend {backend}")
    return f"h3lab verify{flags} --record" + (" --real" if real else "")


def verify(backend: str, device: str, *, real: bool = True) -> dict[str, Any]:
    """Recompute here the digests of the set that `backend` on `device` must give, and compare.

    Checks every part the set publishes (the real-shape problem only with `real`). Where nothing is
    published for this backend and architecture, computes the CPU_PARTS and returns them unchecked
    (status "unpublished"), with the command that publishes them.

    Returns {"set", "path", "backend", "device", "node_type", "status": "match" | "mismatch" |
    "unpublished", "match", "first_mismatch", "tensors": {name: {"expected", "got"}}, "record_command"},
    and for a published set "scope", "recorded_on", "observations" ({node type: parts}),
    "not_observed" (the parts checked that this node type has not reproduced before) and
    "expected_not_observed".

    Raises:
        ValueError: a backend outside the contract, triton on a CPU, or a GPU it cannot run on.
    """
    name = set_name(backend, device)
    if backend in EMULATED:
        return verify_emulated(backend, device)
    node = node_type(device)
    published = load_set(name)
    out: dict[str, Any] = {
        "set": name,
        "path": str(set_path(name)),
        "backend": backend,
        "device": str(torch.device(device)),
        "node_type": node,
        "record_command": record_command(backend, device),
    }
    if published is None:
        got = flatten(compute(backend, device, list(CPU_PARTS)))
        tensors = {n: {"expected": None, "got": d} for n, d in got.items()}
        return out | {"status": "unpublished", "match": False, "first_mismatch": None, "tensors": tensors}
    parts = [p for p in PARTS if p in published and (real or p != "real")]
    expected = flatten({p: published[p] for p in parts})
    got = flatten(compute(backend, device, parts))
    names = list(expected)  # the recorded order: out, dx, dtemb, dw.<parameter>..., trajectory.*, real.*
    mismatched = [n for n in names if got.get(n) != expected[n]]
    match = not mismatched and got.keys() == expected.keys()
    observations = {n: list(o["parts"]) for n, o in published["observations"].items()}
    return out | {
        "record_command": record_command(backend, device, real="real" in parts),
        "status": "match" if match else "mismatch",
        "match": match,
        "first_mismatch": mismatched[0] if mismatched else None,
        "tensors": {n: {"expected": expected[n], "got": got.get(n)} for n in names},
        "scope": published["scope"],
        "recorded_on": published["recorded_on"],
        "observations": observations,
        "not_observed": [p for p in parts if p not in observations.get(node, [])],
        "expected_not_observed": list(published["expected_not_observed"]),
    }


def _published_for_emulation(backend: str) -> dict[str, Any]:
    name = EMULATED[backend]
    published = load_set(name)
    if published is None:
        raise ValueError(
            f"no golden set {name!r} ({set_path(name)}) for backend {backend!r} to reproduce; allowed: record it on "
            f"an {name} GPU first: {record_command('triton', 'cuda', real=True)}"
        )
    return published


def emulated_digests(backend: str, parts: list[str]) -> dict[str, dict[str, str]]:
    """The digests of `parts` through an emulated backend on the CPU. A part that needs a model the
    emulator does not have yet (h3lab.emulate.sfu) raises ValueError naming it."""
    try:
        return compute(backend, "cpu", parts)
    except NotImplementedError as err:
        raise ValueError(f"backend {backend!r} cannot compute {'/'.join(parts)} here: {err}") from None


def verify_emulated(backend: str, device: str) -> dict[str, Any]:
    """`verify` for an emulated backend: the published set's EMULATED_PARTS recomputed here."""
    published = _published_for_emulation(backend)
    parts = [p for p in EMULATED_PARTS if p in published]
    expected = flatten({p: published[p] for p in parts})
    got = flatten(emulated_digests(backend, parts))
    mismatched = [n for n in expected if got.get(n) != expected[n]]
    match = not mismatched and got.keys() == expected.keys()
    emulated = published.get("emulated", {})
    return {
        "set": published["set"],
        "path": str(set_path(published["set"])),
        "backend": backend,
        "device": str(torch.device(device)),
        "node_type": node_type(device),
        "record_command": f"h3lab verify --backend {backend} --record",
        "status": "match" if match else "mismatch",
        "match": match,
        "first_mismatch": mismatched[0] if mismatched else None,
        "tensors": {n: {"expected": expected[n], "got": got.get(n)} for n in expected},
        "scope": published["scope"],
        "recorded_on": published["recorded_on"],
        "observations": {n: list(o["parts"]) for n, o in published["observations"].items()},
        "emulated": list(emulated.get("parts", [])),
        "not_observed": [p for p in parts if p not in emulated.get("parts", [])],
        "expected_not_observed": list(published["expected_not_observed"]),
    }


def record_emulated(backend: str, spot_check: dict[str, Any] | None = None) -> Path:
    """Write into the emulated architecture's set which parts `backend` reproduces here (its
    `emulated` field: parts, date, software, and `spot_check`'s totals if given). Refuses, writing
    nothing, where a digest differs or the spot check found a mismatching element."""
    published = _published_for_emulation(backend)
    res = verify_emulated(backend, "cpu")
    where = f"golden set {published['set']!r}: backend {backend!r}"
    if not res["match"]:
        raise ValueError(f"{where} differs, first at {res['first_mismatch']}; nothing recorded (the emulator is wrong)")
    entry: dict[str, Any] = {"backend": backend, "parts": [p for p in EMULATED_PARTS if p in published]}
    if spot_check is not None:
        if spot_check["mismatching"] or not spot_check["elements"]:
            raise ValueError(
                f"{where}: the real-shape spot check found {spot_check['mismatching']} mismatching of "
                f"{spot_check['elements']} elements; nothing recorded"
            )
        keys = ("elements", "mismatching", "missing_models")
        entry["real_spot_check"] = {k: spot_check[k] for k in keys} | {"methods": sorted(spot_check["by_method"])}
    env = capture("cpu")
    entry |= {"date": time.strftime("%Y-%m-%d"), "environment": {k: env[k] for k in ("torch", "platform")}}
    return write_json(writable_set_path(published["set"]), published | {"emulated": entry})


def _problems(parts: list[str]) -> dict[str, dict[str, Any]]:
    problem = {"block": REFERENCE, "trajectory": TRAJECTORY, "train": TRAIN, "real": REAL}
    return {PROBLEM_KEYS[p]: problem[p].to_dict() | {"device": None, "backend": None} for p in parts}


def problem_record(stored: dict[str, Any]) -> dict[str, Any]:
    """A set's stored problem as this code's `Problem` reads it: a field added to `Problem` after the
    set was recorded takes its default (which leaves the problem as it was), so the stored and the
    current record compare field for field."""
    as_problem = Problem.from_dict(stored | {"device": "cpu", "backend": "torch"})
    return as_problem.to_dict() | {"device": None, "backend": None}


def _check_same(old: dict[str, Any], new: dict[str, Any], parts: list[str], command: str) -> None:
    """Refuse to record into a published set what differs from it: another contract, another
    problem, or other digests (named at the first differing tensor)."""
    where = f"golden set {old['set']!r}"
    fix = f"a set is re-recorded only when the arithmetic is meant to change: {command} --replace"
    if old["contract"] != new["contract"]:
        raise ValueError(f"{where} is for contract {old['contract']!r}, this code is {new['contract']!r}; {fix}")
    for part in parts:
        if part not in old:
            continue
        key = PROBLEM_KEYS[part]
        if problem_record(old[key]) != new[key]:
            raise ValueError(f"{where}: {key} {old[key]} differs from this code's {new[key]}; {fix}")
        differing = [t for t, d in old[part].items() if new[part].get(t) != d]
        if differing or old[part].keys() != new[part].keys():
            first = differing[0] if differing else "the tensor names"
            raise ValueError(f"{where}: this machine's {part} differ, first at {first}; {fix}")


def record(backend: str, device: str, *, real: bool = False, replace_set: bool = False) -> Path:
    """Compute this machine's digests and write them into the set `backend` on `device` must give.

    A new set is recorded on this node type. Into a published set, digests equal to it add this node
    type's observation (its parts, date and software); other digests raise unless `replace_set`,
    which rewrites the set with this node type as its only observation. `real` adds the real-shape
    problem. Returns the set's path.

    Raises:
        ValueError: what `set_name` refuses; digests, problems or contract that differ from the
            published set without `replace_set`.
    """
    name = set_name(backend, device)
    if backend in EMULATED:
        raise ValueError(f"backend {backend!r} never writes digests; allowed: record_emulated (h3lab verify --record)")
    path = writable_set_path(name)  # refused before any digest is computed
    node = node_type(device)
    parts = list(CPU_PARTS) + (["real"] if real else [])
    published = load_set(name)
    if replace_set and published is not None and "real" in published and not real:
        raise ValueError(
            f"golden set {name!r} holds the real-shape problem and --replace rewrites the whole set; "
            f"allowed: {record_command(backend, device, real=True)} --replace"
        )
    new = {"contract": CONTRACT_ID, **_problems(parts), **compute(backend, device, parts)}
    old = None if replace_set else published
    if old is not None:
        _check_same(old, new, parts, record_command(backend, device, real=real))
    old = old or {"recorded_on": node, "observations": {}}
    # what the set holds stays as it was written (equal to `new` where both have it: `_check_same`)
    merged = new | {k: v for k, v in old.items() if k in PARTS or k in PROBLEM_KEYS.values()}
    env = capture(device)
    observations = dict(old["observations"])
    seen = set(parts) | set(observations.get(node, {}).get("parts", []))
    observations[node] = {
        "parts": [p for p in PARTS if p in seen],
        "date": time.strftime("%Y-%m-%d"),
        "environment": {k: env[k] for k in RECORD_FIELDS} | {"gpus": env["gpus"]},
    }
    what, nodes = scope(name)
    data = {"set": name, "backend": backend, "contract": CONTRACT_ID, "scope": what}
    data |= {"recorded_on": old["recorded_on"], "observations": observations}
    data["expected_not_observed"] = [n for n in nodes if n not in observations]
    for part in PARTS:
        if part in merged:
            data[PROBLEM_KEYS[part]] = merged[PROBLEM_KEYS[part]]
            data[part] = merged[part]
    if old.get("emulated") is not None:  # the same digests: what the emulator reproduced still holds
        data["emulated"] = old["emulated"]
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json(path, data)
