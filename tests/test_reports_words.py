"""reports/ is a product: no one-off script or log in it, and no name or text that refers to an occasion
of work (a working session, a numbered call, a stop) in it or in the README.

Published folders hold report.html, report.json, env.json, data/, one JSON per benchmark, a README and
a screenshot (h3lab.workbench.folder); anything else is history, which git keeps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "reports"
OCCASION = re.compile(r"\bsessions?\b|session\d|\bcalls?\s*\d|call\d|\bstops?\s*\d|stop\d", re.IGNORECASE)
NOT_A_PRODUCT = (".sh", ".py", ".log", ".txt", ".ipynb", ".out")
TEXT = (".md", ".html", ".json")
BASE64 = re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]+")


def _files() -> list[Path]:
    return sorted(p for p in REPORTS.rglob("*") if p.is_file())


def test_reports_hold_no_script_no_log_and_no_occasion_in_a_name():
    for path in [*_files(), *(p for p in REPORTS.rglob("*") if p.is_dir())]:
        rel = path.relative_to(REPO).as_posix()
        assert path.suffix not in NOT_A_PRODUCT, f"{rel}: a script or a log; results go to runs/, git keeps history"
        assert not OCCASION.search(rel), f"{rel}: named after an occasion of work"
        assert not path.name.startswith("."), f"{rel}: a staging or kept folder of `h3lab publish` left behind"


@pytest.mark.parametrize("path", [REPO / "README.md", *(p for p in _files() if p.suffix in TEXT)], ids=str)
def test_no_text_refers_to_an_occasion_of_work(path):
    text = BASE64.sub("", path.read_text(errors="replace"))  # inline figures: letters, not words
    found = [m.group(0) for m in OCCASION.finditer(text)]
    assert not found, f"{path.relative_to(REPO)}: {found[:5]}"


def test_every_published_folder_has_a_readme_that_names_its_command():
    folders = [p for p in REPORTS.iterdir() if p.is_dir()]
    assert folders
    for d in folders:
        readme = (d / "README.md").read_text()
        assert "h3lab publish --node" in readme, f"{d.name}/README.md: the command that regenerates it"
        assert len(readme.splitlines()) <= 60, f"{d.name}/README.md: about one screen"
