"""Nothing a user wrote is overwritten or mixed: one run per folder, even when two start at once;
default names that do not collide; a sweep's --out refused before anything in it is touched."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from h3lab.cli import main
from h3lab.cli.run import default_out
from h3lab.io.rundir import claim

PAIRS = 20


def test_of_two_runs_claiming_one_folder_at_once_exactly_one_wins(tmp_path):
    for i in range(PAIRS):
        out = tmp_path / f"run{i}"
        if i % 2:
            out.mkdir()  # an existing empty folder is raced for the same way
        barrier, won, refused = threading.Barrier(2), [], []

        def contender(out: Path = out, barrier: threading.Barrier = barrier, won=won, refused=refused) -> None:
            barrier.wait()
            try:
                won.append(claim(out))
            except ValueError as err:
                refused.append(str(err))

        threads = [threading.Thread(target=contender) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 1, (i, won, refused)
        assert "claimed by another run" in refused[0], refused[0]
        assert [p.name for p in out.iterdir()] == ["owner.json"]


def test_default_run_folders_started_in_one_second_differ():
    names = [default_out() for _ in range(20)]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"run-\d{8}-\d{6}-[0-9a-f]{6}", n.name) for n in names)


def test_reproduce_refuses_an_existing_out_before_touching_it(tmp_path, capsys):
    out = tmp_path / "old-sweep"
    out.mkdir()
    (out / "reproduce.ipynb").write_text("the record of an earlier sweep")
    assert main(["workbench", "reproduce", "--out", str(out), "-p", "layouts", "tp2", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "is not empty (holds reproduce.ipynb)" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["reproduce.ipynb"]
    assert (out / "reproduce.ipynb").read_text() == "the record of an earlier sweep"


@pytest.mark.parametrize("what", ["summary.json", "sweep.json"])
def test_a_folder_holding_a_run_says_what_state_that_run_is_in(tmp_path, what):
    out = tmp_path / "run"
    out.mkdir()
    (out / what).write_text('{"status": "passed"}')
    with pytest.raises(ValueError, match=r"'.*/run' is passed; it is never overwritten: choose a new folder"):
        claim(out)


def test_no_run_folder_goes_inside_the_published_reports(tmp_path, capsys):
    """reports/ is written only by `h3lab publish`, which swaps in a folder it built whole: a run folder
    inside it would be mixed into a published folder."""
    from h3lab.io.env import REPO
    from tests.conftest import RUN, one_line_error

    clone = tmp_path / "clone"  # another checkout: a reports/ beside pyproject.toml and h3lab/
    (clone / "h3lab").mkdir(parents=True)
    (clone / "pyproject.toml").write_text("")
    (clone / "reports" / "cpu").mkdir(parents=True)
    for out in (REPO / "reports" / "cpu" / "h3lab-test-run", clone / "reports" / "cpu" / "myrun", clone / "reports"):
        one_line_error(capsys, [*RUN, "--out", str(out)], f"--out {str(out)!r} is inside", "allowed: a folder outside")
        assert not out.exists() or out == clone / "reports"
    assert [p.name for p in (clone / "reports").iterdir()] == ["cpu"] and not any((clone / "reports" / "cpu").iterdir())
    assert claim(tmp_path / "reports" / "run")  # a folder merely named reports is no published folder


def test_explore_never_replaces_an_existing_out_unasked(tmp_path, capsys, monkeypatch):
    """`workbench explore --out EXISTING.ipynb` replaced the user's file. Now it is refused; --force
    replaces it and its .json once the notebook has ended, built beside them first (the execution is
    faked here: what it writes, and where, is what counts)."""
    from h3lab.workbench import notebooks
    from tests.conftest import one_line_error

    out = tmp_path / "mine.ipynb"
    out.write_text("my notebook")
    one_line_error(capsys, ["workbench", "explore", "--out", str(out)], "mine.ipynb'] exist", "--force")
    assert [p.name for p in tmp_path.iterdir()] == ["mine.ipynb"] and out.read_text() == "my notebook"
    written = []

    def execute(name, output, parameters, **kwargs):
        assert not Path(output).exists() and out.read_text() == "my notebook"  # the old file stays meanwhile
        written.append((Path(output), Path(parameters["record"])))
        Path(output).write_text("executed")
        Path(parameters["record"]).write_text("{}")

    monkeypatch.setattr(notebooks, "execute", execute)
    assert main(["workbench", "explore", "--out", str(out), "--force"]) == 0
    assert out.read_text() == "executed" and (tmp_path / "mine.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.ipynb", "mine.json"]
    assert written[0][0].parent == tmp_path and written[0][0].name.startswith(".mine.ipynb.")
    one_line_error(capsys, ["workbench", "explore", "--out", str(tmp_path / "x.json")], "ending in .ipynb")


def test_a_sweep_never_mixes_into_a_folder_that_holds_files(tmp_path):
    """The reproduce notebook run directly (papermill, Jupyter) with run_dir = a folder of the user's
    wrote env.json, params.json and its runs among the user's files."""
    from h3lab.workbench.params import ReproduceParams
    from h3lab.workbench.sweep import prepare

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"run_dir '.*mine' holds \['notes\.txt'\]; allowed: a new or empty folder"):
        prepare(ReproduceParams(layouts="tp2", run_dir=mine))
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
