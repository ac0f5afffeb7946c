"""What an installed wheel needs beside the code: the pinned kernel configurations and the golden
digests ship as package data (h3lab/kernels, a link to the checkout's kernels/), so a non-editable
install runs the triton backend and `h3lab verify` as a checkout does."""

from __future__ import annotations

import tomllib
from pathlib import Path, PurePosixPath

from h3lab.triton.configs import kernels_dir

REPO = Path(__file__).resolve().parents[1]


def test_the_package_links_the_checkouts_kernels_and_reads_them():
    link = REPO / "h3lab" / "kernels"
    assert link.is_symlink() and link.resolve() == (REPO / "kernels").resolve()
    assert kernels_dir({}) == (REPO / "kernels").resolve()  # the files `h3lab verify --record` writes


def test_package_data_covers_every_pinned_file_and_golden_set():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["h3lab"]
    files = sorted(p.relative_to(REPO / "kernels").as_posix() for p in (REPO / "kernels").rglob("*.json"))
    assert {"sm90.json", "golden/sm90.json", "golden/torch.json"} <= set(files)
    # PurePosixPath.match: a * stays within one folder, as in setuptools' globs (matched from the right)
    missed = [f for f in files if not any(PurePosixPath(f"kernels/{f}").match(g) for g in globs)]
    assert missed == [], f"{missed}: not in pyproject.toml's package data: a wheel would not carry them"
