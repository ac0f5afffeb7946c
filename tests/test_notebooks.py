"""The notebooks run through papermill with CI parameters; their run directories hold what they claim.

One reproduce sweep (tp2 and tp2xcp2+sp, 64 rows, deterministic and baseline) is shared by the
explore and report tests. Bitwise verdicts are checked exactly, against the tensors on disk.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pandas as pd
import pytest
from safetensors.torch import load_file

from h3lab.cli import main
from h3lab.metrics import compare
from h3lab.run.problem import Problem
from h3lab.workbench import notebooks
from h3lab.workbench.params import ExploreParams, ReportParams, ReproduceParams, YourCodeParams
from h3lab.workbench.publish import chromium

pytestmark = pytest.mark.notebooks
CI = {"layouts": ["tp2", "tp2xcp2+sp"], "rows": 64, "modes": ["deterministic", "baseline"], "seeds": [0]}
SLUGS = {"tp2": "tp2", "tp2xcp2+sp": "tp2xcp2_sp"}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "ci-sweep"
    run_dir.mkdir()
    notebooks.execute("reproduce", run_dir / "reproduce.ipynb", CI | {"run_dir": str(run_dir)})
    return run_dir


def _errors(nb: nbformat.NotebookNode) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]


# ---- sources -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", notebooks.NOTEBOOKS)
def test_sources_are_output_free_with_one_parameters_cell(name):
    path = notebooks.source(name)
    nb = jupytext.read(path)
    assert notebooks.parameters_cell(nb) >= 0  # exactly one, or it raises
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in nb.cells)
    assert notebooks.to_notebook(name).metadata["kernelspec"]["name"] == "python3"
    tracked = subprocess.run(
        ["git", "ls-files", "notebooks/*.ipynb"], capture_output=True, text=True, cwd=notebooks.NOTEBOOKS_DIR.parent
    ).stdout.split()
    for ipynb in tracked:  # executed copies belong in runs/; a committed one must be stripped
        assert all(not c.get("outputs") for c in nbformat.read(notebooks.NOTEBOOKS_DIR.parent / ipynb, 4).cells)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (ReproduceParams, {"layouts": "ring8"}, r"layouts='ring8': unknown layout 'ring8'; allowed: tp1, tp2"),
        (ReproduceParams, {"layouts": "tp3"}, r"layouts='tp3': tp=3 not allowed; allowed: \[1, 2, 4, 8\]"),
        (ReproduceParams, {"modes": ["fast"]}, r"unknown mode 'fast'; allowed: \['deterministic', 'baseline'\]"),
        (ReproduceParams, {"checkpoint": "/nonexistent/ckpt"}, r"checkpoint='/nonexistent/ckpt' does not exist"),
        (ReproduceParams, {"seeds": []}, r"parameter seeds=\[\]; allowed"),
        (ReproduceParams, {"train_steps": 2, "modes": "deterministic"}, r"train_steps=2 without blocks; allowed"),
        (ReproduceParams, {"train_steps": 1, "trajectory": 1, "blocks": "0-1"}, r"allowed: one of them"),
        (ReproduceParams, {"train_steps": -1}, r"train_steps=-1; allowed: 0 or a number of training steps"),
        (ReproduceParams, {"train_steps": 1, "blocks": "0-1"}, r"'baseline' with train_steps; allowed"),
        (ExploreParams, {"tensor": "dw"}, r"parameter tensor='dw'; allowed"),
        (ReportParams, {"runs": []}, r"parameter runs=\[\]; allowed"),
        (YourCodeParams, {"layouts": "ring8"}, r"layouts='ring8': unknown layout 'ring8'; allowed: tp1, tp2"),
        (YourCodeParams, {"steps": 0}, r"parameter steps=0; allowed: an int >= 1"),
        (YourCodeParams, {"script": "/nonexistent/train.py"}, r"script='/nonexistent/train.py' is not a file"),
    ],
)
def test_parameters_name_the_value_and_the_allowed_set(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize(
    "fields",
    [{"rows": 0}, {"rows": "8"}, {"repeats": 0}, {"block": -1}, {"seed": -1}, {"backend": "cuda"}, {"device": "tpu"}],
)
def test_a_notebook_and_the_cli_refuse_a_bad_value_in_one_validator(fields):
    """ReproduceParams builds the Problems it will run, so a value is checked by Problem.validate, as
    for `h3lab run`: the same message, after the parameters' prefix."""
    with pytest.raises(ValueError) as problem:
        Problem(**fields)
    param = {"seeds": [fields["seed"]]} if "seed" in fields else fields
    with pytest.raises(ValueError, match=r"^parameters: ") as notebook:
        ReproduceParams(**param, layouts="tp2", modes="deterministic")
    assert str(notebook.value) == f"parameters: {problem.value}"


# ---- bad parameters stop the first cell ------------------------------------------------------------
def test_unknown_layout_stops_the_first_cell_with_a_nonzero_papermill_exit(tmp_path):
    src = tmp_path / "reproduce.ipynb"
    nbformat.write(notebooks.to_notebook("reproduce"), src)
    out = tmp_path / "out.ipynb"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "papermill",
            str(src),
            str(out),
            "-p",
            "layouts",
            "ring8",
            "-p",
            "run_dir",
            str(tmp_path / "run"),
            "--no-progress-bar",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    assert "ValueError" in res.stderr and "unknown layout 'ring8'; allowed: tp1, tp2" in res.stderr
    nb = nbformat.read(out, 4)
    (err,) = _errors(nb)
    first = next(c for c in nb.cells if c.cell_type == "code" and not c.metadata.get("tags"))  # after the parameters
    assert err in first.outputs and err.ename == "ValueError"
    assert not (tmp_path / "run" / "params.json").exists()  # nothing ran


def test_missing_checkpoint_stops_the_first_cell_with_exit_2(tmp_path, capsys):
    rc = main(
        [
            "workbench",
            "reproduce",
            "-p",
            "checkpoint",
            "/nonexistent/ckpt",
            "--out",
            str(tmp_path / "run"),
            "--no-report",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 2
    assert "stopped in cell 3: ValueError: parameter checkpoint='/nonexistent/ckpt' does not exist" in out
    assert not (tmp_path / "run" / "params.json").exists()


# ---- reproduce ------------------------------------------------------------------------------------
def test_reproduce_writes_the_run_directory_and_exact_verdicts(sweep_dir):
    assert _errors(nbformat.read(sweep_dir / "reproduce.ipynb", 4)) == []
    env = json.loads((sweep_dir / "env.json").read_text())
    assert env["node_type"] == "CPU" and env["torch"] and "commit" in env["git"]
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert sweep["status"] == "passed" and sweep["deterministic_all_equal"] is True
    assert sweep["layouts_run"] == sweep["layouts_planned"] == 4 and sweep["accuracy_bitwise_equal"] is True
    verdicts = pd.read_parquet(sweep_dir / "verdicts.parquet")
    assert len(verdicts) == 2 * 2 * 15
    for mode in CI["modes"]:
        d = sweep_dir / mode / "seed0"
        summary = json.loads((d / "summary.json").read_text())
        canonical = load_file(str(d / "canonical.safetensors"))
        for layout, slug in SLUGS.items():
            ours = load_file(str(d / "layouts" / f"{slug}.safetensors"))
            rec = summary["layouts"][layout]["tensors"]
            table = verdicts[(verdicts["mode"] == mode) & (verdicts["layout"] == layout)].set_index("tensor")
            for name, ref in canonical.items():  # recorded verdict == the bytes on disk, exactly
                c = compare(ours[name], ref)
                assert rec[name]["bitwise_equal"] == c.bitwise_equal and rec[name]["max_ulp"] == c.max_ulp
                assert bool(table.loc[name, "bitwise_equal"]) == c.bitwise_equal
                assert int(table.loc[name, "num_differing"]) == c.num_differing
                if mode == "deterministic":
                    assert c.bitwise_equal, (layout, name)
    ranks = pd.read_parquet(sweep_dir / "ranks.parquet")
    assert sorted(ranks.groupby("layout")["rank"].nunique().items()) == [("tp2", 2), ("tp2xcp2+sp", 4)]
    assert (ranks["forward_s"] > 0).all() and (ranks[ranks["layout"] == "tp2"]["bytes_sent"] > 0).all()
    acc = json.loads((sweep_dir / "accuracy.json").read_text())
    assert acc["determinism"]["bitwise_equal"] is True and acc["rows"] == 64
    assert (sweep_dir / "figures" / "heatmap-cpu.png").stat().st_size > 10_000


# ---- explore --------------------------------------------------------------------------------------
def test_explore_records_one_layout(sweep_dir, tmp_path):
    out = tmp_path / "explore.ipynb"
    params = {"run_dir": str(sweep_dir), "layout": "tp2xcp2+sp", "mode": "baseline", "tensor": "dx"}
    nb = notebooks.execute("explore", out, params | {"record": str(tmp_path / "explore.json")})
    assert _errors(nb) == []
    pngs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 2  # the layout's heatmap and the per-element map
    assert not list(sweep_dir.glob("*/seed*/explore"))  # the run explored is read, never written
    record = json.loads((tmp_path / "explore.json").read_text())
    summary = json.loads((sweep_dir / "baseline" / "seed0" / "summary.json").read_text())
    recorded = {r["tensor"]: r["bitwise_equal"] for r in record["tensors"]}
    assert recorded == {k: t["bitwise_equal"] for k, t in summary["layouts"]["tp2xcp2+sp"]["tensors"].items()}
    assert {r["tensor"] for r in record["fp64"]} == set(recorded)
    assert all(0 < r["layout rel L2"] < 0.05 for r in record["fp64"])  # bf16 against FP64: ~1e-2 at most
    assert record["decisions"] and {"site", "op", "algorithm", "bytes_sent"} <= set(record["decisions"][0])


# ---- report ---------------------------------------------------------------------------------------
def test_report_is_self_contained_and_renders_in_chromium(sweep_dir, tmp_path, capsys):
    root = tmp_path / "reports"
    assert main(["report", str(sweep_dir), "--root", str(root)]) == 0
    page = root / "cpu" / "report.html"
    text = page.read_text()
    assert "<script src=" not in text and 'src="http' not in text and "cdnjs" not in text  # opens offline
    assert text.count('src="data:image/png;base64,') >= 3  # heatmap + per-element maps of both modes
    assert "<table" in text and "tp2xcp2+sp" in text and "from h3lab.workbench" not in text  # no code cells
    assert "report.html" in (root / "index.html").read_text()
    assert json.loads((root / "cpu" / "report.json").read_text())["deterministic_passed"] == 2
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    (elsewhere / "index.html").write_text("my own index")  # --out elsewhere leaves it alone unasked
    assert main(["report", str(sweep_dir), "--out", str(elsewhere / "page"), "--no-fp64", "--no-screenshot"]) == 0
    assert (elsewhere / "index.html").read_text() == "my own index" and (elsewhere / "page" / "report.html").is_file()
    exe = chromium()
    if exe is None:
        pytest.skip("Chromium not installed (/usr/bin/chromium; Debian: apt-get install -y chromium)")
    dom = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "<table" in dom and dom.count("data:image/png;base64,") >= 3
    assert 'alt="CPU, block 0, 64 rows, checkpoint of the tiny config: every layout against the' in dom
    import matplotlib.image

    shot = matplotlib.image.imread(root / "cpu" / "screenshot.png")
    assert shot.shape[0] > 1000 and shot[..., :3].std() > 0.05  # not a blank page


def test_a_training_sweep_runs_the_train_task_and_folds_its_tensors_by_kind():
    """train_steps makes the sweep's runs training runs (h3lab run --train-steps); the heatmap folds a
    training run's hundreds of tensors into loss, clip, gradients and weights (the per-step table
    beside the verdicts says which step)."""
    from h3lab.workbench.sweep import sweep_problem
    from h3lab.workbench.views import collapsed

    p = ReproduceParams(train_steps=2, blocks="0-3", modes="deterministic", layouts="tp2")
    assert p.task == "train"
    problem = sweep_problem(p.to_dict() | {"task": p.task}, "deterministic", 0)
    assert (problem.task, problem.steps, problem.block, problem.last_block) == ("train", 2, 0, 3)
    folded = {
        "step1.loss": "loss",
        "step2.loss.video": "loss",
        "step1.clip_coef": "clip",
        "step1.dw.proj_in.weight": "gradients",
        "step2.block3.dw.ff.gate@u5": "gradients",
        "step2.block0.w.norm1.weight": "weights",
        "block3.dw.ff.gate@u5": "dw.ff.gate",  # a chain's, as before
    }
    assert {name: collapsed(name) for name in folded} == folded


# ---- your code ------------------------------------------------------------------------------------
def test_your_code_runs_the_example_script_under_a_layout_and_shows_every_parameter(tmp_path):
    run = tmp_path / "compare"
    params = {"layouts": ["tp2"], "steps": 1, "run_dir": str(run)}
    nb = notebooks.execute("your_code", tmp_path / "your_code.ipynb", params)
    assert _errors(nb) == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "passed" and summary["layouts"]["tp2"]["status"] == "passed"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("transformer_blocks.1.ff.net.2.weight" in h and "equal" in h for h in html)  # the per-parameter table
    printed = "".join(o.get("text", "") for o in outputs)
    assert "step 1: loss" in printed and "tp2: passed" in printed  # in the kernel, then under the layout
    assert (run / "heatmap.png").stat().st_size > 10_000
