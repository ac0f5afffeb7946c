"""Every run ends in a true, final state: summary.json says passed, failed or interrupted, with the
error, however the run ends short of a SIGKILL of the runner (tests/test_run_processes.py covers
that one): an error, a hang or a signal in the canonical phase, a tampered checkpoint, a full disk;
requests that cannot run are refused before any folder exists. The same for `h3lab accuracy` and
the sweep's sweep.json."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import h3lab.io.rundir as rundir
from h3lab import H3Config
from h3lab.cli import main
from h3lab.io.checkpoint import synthesize_checkpoint
from h3lab.io.jsonfile import write_json
from h3lab.parallel.layout import parse_layouts
from h3lab.run.problem import Problem
from h3lab.run.runner import RunRequest, run
from tests.conftest import leftovers, sigint_at_default


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _request(out: Path, layouts: str = "tp1", timeout_s: float = 240, **problem) -> RunRequest:
    problem = {"rows": 8, "seed": 31} | problem
    return RunRequest(layouts=tuple(parse_layouts(layouts)), problem=Problem(**problem), out=out, timeout_s=timeout_s)


def _tampered_checkpoint(tmp_path: Path) -> Path:
    path = Path(synthesize_checkpoint(tmp_path / "ckpt", H3Config.tiny(), num_blocks=1, seed=32, single_file=True))
    shard = path / "diffusion_pytorch_model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's bytes: same size, another sha256
    shard.write_bytes(bytes(data))
    return path


def test_a_checkpoint_failing_verification_fails_the_run_with_the_error(tmp_path):
    ckpt = _tampered_checkpoint(tmp_path)
    summary = run(_request(tmp_path / "run", synthetic=None, checkpoint=str(ckpt)))
    assert summary == _summary(tmp_path / "run")
    assert summary["status"] == "failed" and summary["canonical"]["status"] == "failed"
    assert "diffusion_pytorch_model.safetensors: sha256" in summary["error"] and "contents changed" in summary["error"]
    assert summary["canonical"]["failure"]["log"].endswith("canonical.log")
    assert summary["checkpoint"]["manifest_verified"] is True and summary["layouts"] == {}
    assert not leftovers(summary["owner"]["token"])


def test_the_timeout_bounds_the_canonical_phase(tmp_path, monkeypatch):
    monkeypatch.setenv("H3LAB_FAULT", "hang:canonical")
    started = time.monotonic()
    summary = run(_request(tmp_path / "run", timeout_s=6))
    assert time.monotonic() - started < 60
    assert summary["status"] == "failed" and "canonical process hung: still running after" in summary["error"]
    assert _summary(tmp_path / "run")["status"] == "failed"
    assert not leftovers(summary["owner"]["token"])


def test_sigterm_in_the_canonical_phase_interrupts_the_run(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "h3lab", "run", "--layout", "tp2", "--synthetic", "tiny", "--rows", "8"]
    env = {**os.environ, "H3LAB_FAULT": "hang:canonical"}
    proc = subprocess.Popen([*cmd, "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while "running" not in _read(out / "canonical.status.json") and time.monotonic() < deadline:
        time.sleep(0.1)
    token = json.loads((out / "owner.json").read_text())["token"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()
    summary = _summary(out)
    assert summary["status"] == "interrupted" and "stopped by a signal" in summary["error"]
    assert "canonical" not in summary and not leftovers(token)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _no_space(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _final_records_need_the_reserve(monkeypatch) -> None:
    """The disk stays full until the writer gives its reserve back: no final record fits before."""

    def write_json_full_disk(path, record, **kw):
        final = record.get("status") not in (None, "running")
        if final and (Path(path).parent / ".reserve").exists():
            raise _no_space(path)
        return write_json(path, record, **kw)

    monkeypatch.setattr(rundir, "write_json", write_json_full_disk)  # write_final's writer


def test_a_full_disk_still_ends_the_run_with_a_final_state(tmp_path, monkeypatch, capsys):
    """The disk fills while the layout is assembled, and stays full until the run gives its reserve back.
    safetensors reports it as SafetensorError, which is no OSError: it escaped the CLI as a traceback.
    The canonical process (a subprocess) writes its file; the layout's, in this process, fails."""
    from safetensors import SafetensorError

    import h3lab.io.tensorfile as tensorfile

    real_save = tensorfile.save_file

    def save_file(tensors, path):
        if Path(path).parent.name == "layouts":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, path)

    monkeypatch.setattr(tensorfile, "save_file", save_file)
    _final_records_need_the_reserve(monkeypatch)
    out = tmp_path / "run"
    assert (
        main(["run", "--layout", "tp1", "--synthetic", "tiny", "--rows", "8", "--seed", "31", "--out", str(out)]) == 1
    )
    err = capsys.readouterr().err.strip()
    assert err == f"h3lab run: error: [Errno 28] No space left on device: '{out / 'layouts' / 'tp1.safetensors'}'"
    summary = _summary(out)
    assert summary["status"] == "failed" and "OSError: [Errno 28] No space left on device" in summary["error"]
    assert summary["canonical"]["status"] == "done" and not (out / ".reserve").exists()
    assert [p.name for p in (out / "layouts").iterdir()] == ["tp1"]  # no partial file left


def test_a_final_record_no_space_can_hold_shrinks_over_the_old_one(tmp_path, monkeypatch):
    path, owner = tmp_path / "summary.json", rundir.owner_record()
    layouts = {f"layout{i}": {"status": "passed", "note": "x" * 200} for i in range(8)}
    write_json(path, {"status": "running", "owner": owner, "started": 1.5, "layouts": layouts})

    def always_full(path, record, **kw):
        raise _no_space(path)

    monkeypatch.setattr(rundir, "write_json", always_full)
    final = {"status": "failed", "error": "OSError: no space", "owner": owner, "started": 1.5, "layouts": layouts}
    rundir.write_final(path, final | {"finished": 2.5})
    assert json.loads(path.read_text()) == {k: final[k] for k in ("status", "error", "owner", "started")} | {
        "finished": 2.5
    }


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) to mount a small tmpfs")
def test_a_really_full_disk_ends_the_run_failed(tmp_path):
    """A 3 MiB tmpfs (a private mount namespace): the canonical result fits, the ranks' shards do not."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user and mount namespaces not permitted here: {probe.stderr.decode().strip()}")
    disk = tmp_path / "disk"
    disk.mkdir()
    h3lab = f"{sys.executable} -m h3lab run --layout tp1 --synthetic tiny --rows 8 --out {disk}/run"
    script = f"mount -t tmpfs -o size=3m tmpfs {disk} && {h3lab}; echo; cat {disk}/run/summary.json"
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    summary = json.loads(res.stdout[res.stdout.rindex("\n{") :])
    assert summary["status"] == "failed", res.stderr[-2000:]
    assert "No space left on device" in json.dumps(summary)  # in the error, or in a layout's failure


def test_requests_that_cannot_run_are_refused_before_any_folder(tmp_path, capsys):
    ckpt = synthesize_checkpoint(tmp_path / "ckpt", H3Config.tiny(), num_blocks=1, seed=33)
    out = tmp_path / "run"
    assert main(["run", "--layout", "tp2", "--checkpoint", str(ckpt), "--block", "5", "--out", str(out)]) == 2
    assert "block 5 is past the checkpoint; allowed: 0..0" in capsys.readouterr().err
    argv = ["run", "--layout", "tp2", "--synthetic", "tiny", "--backend", "triton", "--out", str(out)]
    assert main(argv) == 2
    assert "backend 'triton' runs on CUDA only" in capsys.readouterr().err
    assert not out.exists()


# ---- h3lab accuracy and the sweep ------------------------------------------------------------------
def test_accuracy_run_folders_end_failed_or_interrupted(tmp_path, monkeypatch, capsys):
    ckpt = _tampered_checkpoint(tmp_path)
    out = tmp_path / "acc"
    assert main(["accuracy", "--checkpoint", str(ckpt), "--out", str(out), "--rows", "8"]) == 2
    summary = _summary(out)
    assert summary["status"] == "failed" and "contents changed" in summary["error"]

    import h3lab.cli.accuracy as accuracy

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(accuracy, "block_accuracy", interrupted)
    capsys.readouterr()
    assert main(["accuracy", "--out", str(tmp_path / "acc2"), "--rows", "8"]) == 130  # 128 + SIGINT
    assert capsys.readouterr().err.strip() == "h3lab accuracy: interrupted (Ctrl-C)"
    assert _summary(tmp_path / "acc2")["status"] == "interrupted"

    def disk_full(*args, **kwargs):
        raise _no_space(tmp_path / "acc3")

    monkeypatch.setattr(accuracy, "block_accuracy", disk_full)
    _final_records_need_the_reserve(monkeypatch)
    assert main(["accuracy", "--out", str(tmp_path / "acc3"), "--rows", "8"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    summary = _summary(tmp_path / "acc3")
    assert summary["status"] == "failed" and "No space left on device" in summary["error"]
    assert not (tmp_path / "acc3" / ".reserve").exists()


def test_a_sweep_stopped_short_says_so_in_sweep_json(tmp_path, monkeypatch):
    from h3lab.workbench import sweep
    from h3lab.workbench.params import ReproduceParams
    from h3lab.workbench.rundata import load_sweep

    def broken(req):
        raise RuntimeError("a broken runner")

    monkeypatch.setattr(sweep, "run", broken)
    params = ReproduceParams(layouts="tp2", rows=8, modes="deterministic", accuracy=False, run_dir=tmp_path / "sw")
    with pytest.raises(RuntimeError, match="a broken runner"):
        sweep.run_all(params)
    record = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert record["status"] == "failed" and record["error"] == "RuntimeError: a broken runner"
    assert not (tmp_path / "sw" / ".reserve").exists()  # given back for the final record
    assert load_sweep(tmp_path / "sw").status == "failed"


# ---- one line, never a traceback -------------------------------------------------------------------
def test_ctrl_c_of_h3lab_run_is_one_line_and_an_interrupted_run(tmp_path):
    """SIGINT to the terminal's process group, as Ctrl-C sends it: the state was right, the
    KeyboardInterrupt's traceback was printed after it."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "h3lab", "run", "--layout", "tp2", "--synthetic", "tiny", "--rows", "8"]
    env = {**os.environ, "H3LAB_FAULT": "hang:canonical"}
    proc = subprocess.Popen(
        [*cmd, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=sigint_at_default,
    )
    try:
        deadline = time.monotonic() + 120
        while "running" not in _read(out / "canonical.status.json") and time.monotonic() < deadline:
            time.sleep(0.1)
        token = json.loads((out / "owner.json").read_text())["token"]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 128 + signal.SIGINT
    finally:  # a failed wait leaves no run (and no hanging canonical process) behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "h3lab run: interrupted (Ctrl-C)", err
    summary = _summary(out)
    assert summary["status"] == "interrupted" and summary["error"] == "KeyboardInterrupt (Ctrl-C)"
    assert not leftovers(token)
