"""`h3lab publish`: the benchmark registry as data, resumable stages, the folder built beside and swapped
in, and the whole path end to end on CPU (tiny config, one layout, 32 rows) into a temporary folder.

The end-to-end test shrinks the CPU plan (plans.SWEEPS, registry.BENCHMARKS) to one small sweep, the
CPU block benchmark and one CUDA benchmark that must be skipped with its reason; everything else is
the command as a user runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from h3lab.bench import registry
from h3lab.cli import main
from h3lab.io.env import REPO
from h3lab.workbench import benchmarks, folder, plans
from h3lab.workbench.params import ReproduceParams
from h3lab.workbench.publish import chromium
from h3lab.workbench.stages import StageBook, run_command
from tests.conftest import sigint_at_default

# One layout: the sweep is publish's input; a report of several layouts is tests/test_notebooks.py's
SMALL_SWEEP = {
    "device": "cpu",
    "config": "tiny",
    "layouts": "tp2",
    "rows": 32,
    "modes": ["deterministic", "baseline"],
}


# ---- the registry ---------------------------------------------------------------------------------
def test_every_benchmark_has_a_table_and_a_reason_where_it_does_not_run():
    assert {b.name for b in registry.BENCHMARKS} <= set(benchmarks.TABLES)
    assert len({b.output for b in registry.BENCHMARKS}) == len(registry.BENCHMARKS)  # one file each
    cpu = {p.bench.name: p for p in registry.plan("cpu", 0)}
    assert cpu["gemm"].argv is None and cpu["gemm"].skipped == "needs CUDA; this is a CPU node"
    assert cpu["block_cpu"].argv[:2] == ["-m", "h3lab.bench.block_cpu"]
    one = {p.bench.name: p for p in registry.plan("h200", 1)}
    assert one["block_cpu"].skipped == "not run on gpu nodes"
    assert one["collectives"].skipped == "needs 2 GPUs, one process per GPU; this publish has 1"
    assert one["layouts"].argv[one["layouts"].argv.index("--layouts") + 1] == "tp1"
    eight = {p.bench.name: p for p in registry.plan("h200", 8)}
    assert eight["collectives"].argv[-3:] == ["8", "--device", "cuda"]
    assert "tp8:2x4" in eight["layouts"].argv[eight["layouts"].argv.index("--layouts") + 1]
    with pytest.raises(ValueError, match=r"node 'a100'; allowed: \['cpu', 'h100', 'h200', 'b200'\]"):
        registry.plan("a100", 1)
    with pytest.raises(ValueError, match="unknown benchmark 'gem'; allowed"):
        registry.by_name("gem")


def test_a_node_that_is_not_this_machine_and_unknown_stages_are_refused(tmp_path, capsys):
    assert main(["publish", "--node", "h200", "--work", str(tmp_path / "w")]) == 2
    assert "--node h200, but this machine is a cpu node; allowed: --node cpu" in capsys.readouterr().err
    assert main(["publish", "--node", "cpu", "--only", "sweep,gems", "--work", str(tmp_path / "w")]) == 2
    assert "--only ['gems']; allowed: ['sweep', 'chain', 'trajectory', 'train', 'block_cpu'" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before anything is written
    assert main(["publish", "--node", "cpu", "--only", "render", "--work", str(tmp_path / "w2")]) == 2
    err = capsys.readouterr().err
    assert "render: sweeps ['sweep', 'chain', 'trajectory', 'train'] are not done; allowed: render once every" in err


# ---- stages and the folder ------------------------------------------------------------------------
def test_a_work_folder_has_one_live_owner_and_keeps_done_stages(tmp_path):
    book = StageBook(tmp_path / "w")
    book.claim({"node": "cpu"})
    with pytest.raises(ValueError, match="is in use by pid"):
        StageBook(tmp_path / "w").claim({"node": "cpu"})
    calls = []
    book.run("a", lambda: calls.append(1) or {"state": "done", "output": str(book.attempt("a"))})
    assert book.state("a")["output"].endswith("a-1")
    assert book.run("a", lambda: calls.append(2) or {"state": "done"})["kept"] and calls == [1]
    book.run("a", lambda: calls.append(3) or {"state": "done", "output": str(book.attempt("a"))}, redo=True)
    assert book.state("a")["output"].endswith("a-2") and calls == [1, 3]  # a new path, never the old one
    with pytest.raises(RuntimeError):
        book.run("b", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert book.state("b")["state"] == "failed" and "boom" in book.state("b")["error"]
    book.release()
    with pytest.raises(ValueError, match="holds a publish of"):
        StageBook(tmp_path / "w").claim({"node": "h200"})


def test_a_work_folder_is_new_empty_or_a_publish_s_own(tmp_path):
    """--work ~/notes made stages.json and sweep folders among the user's files; --work inside reports/
    put a work folder into the published reports."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds \['notes\.txt'\] and no stages\.json: not a publish work folder"):
        StageBook(mine).claim({"node": "cpu"})
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match=r"is inside .*, the published reports"):
        StageBook(REPO / "reports" / "publish-work").claim({"node": "cpu"})
    assert not (REPO / "reports" / "publish-work").exists()
    (tmp_path / "empty").mkdir()
    StageBook(tmp_path / "empty").claim({"node": "cpu"})  # an empty folder, or one a publish made, is fine


def _alive_with(marker: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if marker in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


def _leader(marker: str, *, child_ignores_sigterm: bool, leader_waits: bool) -> list[str]:
    """A command that starts a child sleeping under `marker` (ignoring SIGTERM, or not) and then sleeps
    itself or exits at once, leaving the child behind."""
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if child_ignores_sigterm else ""
    child = f"{ignore}import time; time.sleep(120)  # {marker}"
    leader = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(0.5)"
    return [sys.executable, "-c", leader + ("; time.sleep(120)" if leader_waits else "")]


def test_a_command_past_its_time_is_killed_with_its_group(tmp_path):
    """The leader ends at SIGTERM; its child ignores SIGTERM and still goes (SIGKILL to the group)."""
    marker = f"h3lab-stage-test-{os.getpid()}-timeout"
    start = time.monotonic()
    res = run_command(_leader(marker, child_ignores_sigterm=True, leader_waits=True), tmp_path / "x.log", timeout_s=3)
    assert res["timed_out"] and time.monotonic() - start < 40
    assert not _alive_with(marker)


def test_a_command_that_exits_leaves_no_process_of_its_group(tmp_path):
    marker = f"h3lab-stage-test-{os.getpid()}-exit"
    res = run_command(
        _leader(marker, child_ignores_sigterm=False, leader_waits=False), tmp_path / "y.log", timeout_s=60
    )
    assert res["returncode"] == 0 and not res["timed_out"]
    deadline = time.monotonic() + 5  # SIGKILL is delivered at once; the kernel may take a moment to reap
    while _alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive_with(marker)


def test_the_swap_keeps_a_previous_folder_git_does_not_hold(tmp_path):
    reports = tmp_path / "reports"
    (reports / "cpu").mkdir(parents=True)
    (reports / "cpu" / "notes.txt").write_text("mine")
    built = folder.staging(reports, "cpu")
    (built / "README.md").write_text("new")
    kept = folder.swap_in(built, reports / "cpu")
    assert (reports / "cpu" / "README.md").read_text() == "new" and not built.exists()
    assert kept is not None and (kept / "notes.txt").read_text() == "mine"  # not in git: never deleted
    repo = tmp_path / "repo"
    (repo / "reports" / "cpu").mkdir(parents=True)
    (repo / "reports" / "cpu" / "README.md").write_text("old")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "old"], check=True)
    built = folder.staging(repo / "reports", "cpu")
    (built / "README.md").write_text("new")
    assert folder.swap_in(built, repo / "reports" / "cpu") is None  # git holds the old one: deleted
    assert [p.name for p in (repo / "reports").iterdir()] == ["cpu"]


# ---- end to end -----------------------------------------------------------------------------------
def _small_publish(mp: pytest.MonkeyPatch) -> None:
    """A small sweep, the CPU block benchmark and one CUDA benchmark that must be skipped with its reason."""
    block = registry.Benchmark(
        "block_cpu",
        "h3lab.bench.block_cpu",
        "block-cpu.json",
        "the block on CPU",
        {"cpu": ("--config", "tiny", "--rows", "32", "--repeats", "2")},
    )
    mp.setitem(plans.SWEEPS, "cpu", {"sweep": SMALL_SWEEP | {"accuracy": False}})
    mp.setattr(registry, "BENCHMARKS", (block, registry.by_name("gemm")))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """`h3lab publish --node cpu` of `_small_publish` into a temporary folder: (exit status, reports,
    work, argv). The registry and plans are patched for that call only."""
    tmp = tmp_path_factory.mktemp("publish")
    reports, work = tmp / "reports", tmp / "work"
    argv = ["publish", "--node", "cpu", "--work", str(work), "--reports", str(reports)]
    with pytest.MonkeyPatch.context() as mp:
        _small_publish(mp)
        rc = main(argv)
    return rc, reports, work, argv


@pytest.mark.notebooks
def test_publish_runs_end_to_end_on_cpu_into_a_temporary_folder(published, monkeypatch):
    # the plans name their layouts as comma-separated strings (SMALL_SWEEP names one)
    assert ReproduceParams(layouts="tp1,tp2", rows=32, modes="deterministic").layouts == ["tp1", "tp2"]
    rc, reports, work, argv = published
    assert rc == 0
    out = reports / "cpu"
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    want = {"README.md", "report.html", "report.json", "env.json", "block-cpu.json", "data/verdicts.parquet"}
    assert want <= names and not [n for n in names if n.endswith((".py", ".sh", ".log"))]
    readme = (out / "README.md").read_text()
    assert "h3lab publish --node cpu" in readme and "`gemm` (needs CUDA; this is a CPU node)" in readme
    assert len(readme.splitlines()) < 40  # about one screen
    record = json.loads((out / "report.json").read_text())
    assert record["deterministic_passed"] == 1 and record["benchmarks"]["block_cpu"] == "ran"
    page = (out / "report.html").read_text()
    assert "block_cpu: the block on CPU" in page and "Not run here: needs CUDA" in page
    assert "h3lab.bench.block_cpu --config tiny --rows 32 --repeats 2 --out block-cpu.json" in page
    assert [p.name for p in reports.iterdir() if p.name.startswith(".")] == []  # no staging left
    assert "cpu/report.html" in (reports / "index.html").read_text()

    # a render that fails leaves the published folder as it was, and the sweep is kept, not rerun
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _small_publish(monkeypatch)
    monkeypatch.setattr("h3lab.workbench.publish.publish", _failing_publish)
    with pytest.raises(RuntimeError, match="render broke"):
        main([*argv, "--redo", "render"])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in reports.iterdir() if p.name.startswith(".")] == []
    stages = json.loads((work / "stages.json").read_text())["stages"]
    assert stages["render"]["state"] == "failed" and stages["sweep"]["attempts"] == 1


@pytest.mark.notebooks
def test_the_published_page_renders_in_chromium(published):
    if chromium() is None:
        pytest.skip("Chromium not installed (/usr/bin/chromium; Debian: apt-get install -y chromium; .ci/run does)")
    rc, reports, _, _ = published
    out = reports / "cpu"
    assert rc == 0 and (out / "screenshot.png").is_file()
    dom = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", (out / "report.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "<table" in dom and dom.count("data:image/png;base64,") >= 2 and "block_cpu" in dom  # heatmap, maps


@pytest.mark.notebooks
def test_report_writes_new_folders_only_and_never_into_the_runs_it_reads(published, tmp_path, monkeypatch, capsys):
    """`h3lab report RUN --out DIR` wrote report.ipynb into the run it read and replaced DIR's page;
    `h3lab report RUN` rewrote reports/<node>/ in place. The notebook's execution is faked (its output
    file and what it returns): where things are written is what counts."""
    import nbformat

    from h3lab.workbench import notebooks
    from tests.conftest import one_line_error

    rc, reports, work, _ = published
    sweep = work / "sweep-1"
    assert rc == 0 and not (sweep / "report.ipynb").exists()  # publish's notebook is in its work folder
    assert list(work.glob("render-*.ipynb"))

    def execute(name, output, parameters, **kwargs):
        nb = nbformat.v4.new_notebook()
        nbformat.write(nb, str(output))
        return nb

    monkeypatch.setattr(notebooks, "execute", execute)
    monkeypatch.setenv("H3LAB_RUNS", str(tmp_path / "runs"))
    before = {p: p.stat().st_mtime_ns for p in [sweep, *sweep.rglob("*")]}
    published_before = {p: p.read_bytes() for p in reports.rglob("*") if p.is_file()}
    os.chmod(sweep, 0o555)  # a read-only archive of runs (root writes anyway: the listing is compared too)
    try:
        out = tmp_path / "page"
        assert main(["report", str(sweep), "--out", str(out), "--no-screenshot", "--no-fp64"]) == 0
        assert {"report.html", "report.ipynb", "report.json"} <= {p.name for p in out.iterdir()}
        page = (out / "report.html").read_bytes()
        one_line_error(capsys, ["report", str(sweep), "--out", str(out)], "holds files", "--force")
        assert (out / "report.html").read_bytes() == page
        assert main(["report", str(sweep), "--out", str(out), "--force", "--no-screenshot", "--no-fp64"]) == 0
        assert (out / "report.html").is_file() and [p.name for p in tmp_path.glob(".page.previous-*")]
        assert main(["report", str(sweep), "--no-screenshot", "--no-fp64"]) == 0  # a new folder under runs/
        (made,) = (tmp_path / "runs").glob("report-*")
        assert (made / "cpu" / "report.html").is_file() and (made / "index.html").is_file()
        one_line_error(capsys, ["report", str(sweep), "--root", str(REPO / "reports")], "the published reports")
        one_line_error(capsys, ["report", str(sweep), "--out", str(sweep / "page")], "is inside the run")
    finally:
        os.chmod(sweep, 0o755)
    assert {p: p.stat().st_mtime_ns for p in [sweep, *sweep.rglob("*")]} == before
    assert {p: p.read_bytes() for p in reports.rglob("*") if p.is_file()} == published_before


def _failing_publish(*args, **kwargs) -> Path:
    raise RuntimeError("render broke")


@pytest.mark.notebooks
def test_sigterm_stops_a_notebook_sweep_at_once_and_leaves_no_process(tmp_path):
    """papermill's wait on the kernel ignores signals; the CLI kills the kernel first (notebooks.execute)."""
    import psutil

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "h3lab", "workbench", "reproduce", "--out", str(run), "--no-report"]
    argv += ["-p", "layouts", "tp2", "-p", "rows", "16", "-p", "accuracy", "false", "-p", "modes", "[deterministic]"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (run / "params.json").is_file():  # the kernel is running the sweep's first cells
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep never started"
        time.sleep(0.5)
    family = psutil.Process(proc.pid).children(recursive=True)
    assert family  # the kernel, at least
    start = time.monotonic()
    proc.terminate()
    assert proc.wait(timeout=60) == 128 + 15 and time.monotonic() - start < 45
    assert json.loads((run / "sweep.json").read_text())["status"] == "interrupted"
    _, alive = psutil.wait_procs(family, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.notebooks
def test_ctrl_c_of_h3lab_publish_is_one_line_and_an_interrupted_stage(tmp_path):
    """SIGINT to the terminal's process group as the first sweep starts: its stage (and its sweep, once
    started) says interrupted, the work folder is released, nothing is published, no traceback."""
    work, reports = tmp_path / "work", tmp_path / "reports"
    argv = [sys.executable, "-m", "h3lab", "publish", "--node", "cpu", "--work", str(work), "--reports", str(reports)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=sigint_at_default
    )
    try:
        deadline = time.monotonic() + 240
        while not (work / "sweep-1" / "owner.json").is_file():  # the stage claimed its run folder: the notebook starts
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=90)  # -2: SIGINT killed it before Python turned it into KeyboardInterrupt
        assert rc == 128 + signal.SIGINT, (rc, proc.stderr.read().decode()[-3000:])
    finally:  # a failed wait leaves no publish (and no sweep of the whole CPU plan) running after the test
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "h3lab publish: interrupted (Ctrl-C)", err
    book = json.loads((work / "stages.json").read_text())
    assert book["released"] and book["stages"]["sweep"]["state"] == "interrupted"
    sweep = work / "sweep-1" / "sweep.json"  # written once the notebook's first cells have run
    assert not sweep.exists() or json.loads(sweep.read_text())["status"] == "interrupted"
    assert not reports.exists()


def test_every_published_benchmark_record_reads_as_its_table():
    """The committed records (reports/*/<output>) parse into their report tables, with a machine named."""
    outputs = {b.output: b.name for b in registry.BENCHMARKS}
    reports = Path(registry.__file__).parents[2] / "reports"
    found = [(p, outputs[p.name]) for p in sorted(reports.glob("*/*.json")) if p.name in outputs]
    assert {name for _, name in found} >= {"block", "gemm", "attention_long", "profile", "collectives"}
    for path, name in found:
        record = benchmarks.load(path)
        table = benchmarks.table(name, record)
        assert len(table) > 0 and table.notna().any().any(), path
        assert set(benchmarks.provenance(record, "c")) == {"machine", "commit"}


def test_a_run_on_n_gpus_publishes_into_the_folder_with_n():
    from h3lab.workbench.publish import folder_name
    from h3lab.workbench.rundata import Sweep

    gpu = {"name": "NVIDIA H200", "memory_gib": 139.8}
    sweep = lambda env, params: Sweep(Path("r"), env, params, [])  # noqa: E731
    assert folder_name(sweep({"node_type": "CPU", "gpus": [gpu]}, {"gpus": 0})) == "cpu"  # a CPU sweep on a GPU node
    assert folder_name(sweep({"node_type": "H200", "gpus": [gpu] * 8}, {"gpus": 1})) == "h200"
    assert folder_name(sweep({"node_type": "H200", "gpus": [gpu] * 8}, {"gpus": 2})) == "h200x2"
    assert folder_name(sweep({"node_type": "H200", "gpus": [gpu] * 4}, {})) == "h200x4"  # an `h3lab run` folder


def test_a_gpu_publish_narrows_the_visible_gpus_to_its_count(monkeypatch):
    """The benchmarks of `--gpus N` see the first N GPUs: of CUDA_VISIBLE_DEVICES where it is set, else
    of every GPU torch sees (the usual case on a GPU node)."""
    from h3lab.workbench.sweep import first_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert first_gpus(2, None) == "0,1" and first_gpus(2, "") == "0,1"
    assert first_gpus(1, "3,1,2") == "3" and first_gpus(8, "5,6") == "5,6"
