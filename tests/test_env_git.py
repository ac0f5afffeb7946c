"""h3lab.io.env's git record: `tree` names the files a run ran, clean checkout or not, without touching
the checkout's own index (a scratch git repository stands in for the project's)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from h3lab.io import env

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def test_tree_is_the_commit_tree_the_files_match(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    monkeypatch.setattr(env, "REPO", repo)
    env.worktree_id.cache_clear()  # once per process: each state below is a new process's view
    assert env.worktree_id() == _git(repo, "rev-parse", "HEAD^{tree}")
    assert env.code_label(env._git()) == _git(repo, "rev-parse", "--short", "HEAD")  # clean: no tree

    # only a new file on top: not "dirty" to git status, but other files than HEAD's
    (repo / "c.py").write_text("z = 4\n")
    env.worktree_id.cache_clear()
    record = env._git()
    assert record["dirty"] is False and record["tree"] != record["head_tree"] and env.files_changed(record)
    assert env.code_label(record).endswith(f", tree {record['tree'][:7]}")
    (repo / "c.py").unlink()

    # a later commit's files on top of the first, as a device's copy has them: HEAD stays, tree moves
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 3\n")  # untracked, not ignored: part of the code that runs
    (repo / "runs").mkdir()
    (repo / "runs" / "out.json").write_text("{}")  # ignored: not part of it
    status = _git(repo, "status", "--porcelain")
    objects = sorted(p.name for p in (repo / ".git" / "objects").rglob("*") if p.is_file())
    env.worktree_id.cache_clear()
    got = env.worktree_id()
    assert _git(repo, "status", "--porcelain") == status  # the checkout's index is untouched
    assert sorted(p.name for p in (repo / ".git" / "objects").rglob("*") if p.is_file()) == objects  # its store too
    record = env._git()
    assert record["dirty"] is True and record["tree"] == got
    assert env.code_label(record) == f"{record['describe']}, tree {got[:7]}"
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "two")
    assert got == _git(repo, "rev-parse", "HEAD^{tree}")
    env.worktree_id.cache_clear()  # the project's own view for later tests
