"""Files, folders, comments and texts are named by what they measure or change, never by an occasion
of work: no working session, numbered call, stop or date in a name or in the text of the paths below.

What is allowed is what the words mean elsewhere: Python's `slice.stop`, `start_new_session`, pytest's
session scope, a POSIX session, signal names (SIGSTOP), a fault kind `stop:<rank>`. None of those
carries a number, so the patterns below ask for one. A golden digest set records the date of each
observation as data (`"date": "YYYY-MM-DD"` in kernels/golden/), which is allowed.

To cover more of the repository, add its paths to `SCANNED`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# paths (folders or files) relative to the repository root whose names and text are checked
SCANNED = ["h3lab", "tests", "kernels", "notebooks", "ARCHITECTURE.md", "Makefile"]
TEXT_SUFFIXES = {".py", ".md", ".json", ".toml", ".txt", ".yml", ".yaml", ".sh", ".cfg", ".ini", ".ipynb"}
SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".ruff_cache"}
THIS_FILE = Path(__file__).resolve()  # it spells the patterns out

# an occasion of work in text: "session 9", "sessions 5-8", "call 4", "call5", "stop 3", "probe2",
# "last stop", "this session", an ISO date
OCCASION = re.compile(
    r"\bsessions?[ _-]?#?\d+"
    r"|\bcall[ _-]?#?\d+\b"
    r"|\bstop[ _-]?#?\d+\b"
    r"|\bprobe[ _-]?\d+"
    r"|\b(?:last|this|previous|earlier|next) (?:stop|session)\b"
    r"|\b20\d\d-[01]\d-[0-3]\d\b",
    re.IGNORECASE,
)
# an occasion of work in a file or folder name: "session12-call4.sh", "probe3", "stop2", "2026-11-29"
OCCASION_NAME = re.compile(r"session[ _-]?\d+|call[ _-]?\d+|probe[ _-]?\d+|stop[ _-]?\d+|20\d\d-?[01]\d-?[0-3]\d", re.I)
RECORDED_DATE = re.compile(r'^\s*"date": "20\d\d-[01]\d-[0-3]\d",?$')  # a golden set's observation date


def scanned_paths() -> Iterator[Path]:
    """Every file and folder under SCANNED (the SCANNED paths themselves included), sorted."""
    for entry in SCANNED:
        root = REPO / entry
        assert root.exists(), f"SCANNED names {entry}, which does not exist"
        yield root
        if root.is_dir():
            for path in sorted(root.rglob("*")):
                if not SKIPPED_DIRS.intersection(path.relative_to(REPO).parts):
                    yield path


def occasions_in(path: Path) -> list[str]:
    """`file:line: text` for every line of a text file that names an occasion of work."""
    if path.resolve() == THIS_FILE or not (path.suffix in TEXT_SUFFIXES or path.name == "Makefile"):
        return []
    found = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if OCCASION.search(line) and not (path.parent.name == "golden" and RECORDED_DATE.match(line)):
            found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:160]}")
    return found


def test_no_file_or_folder_is_named_after_an_occasion():
    named = [str(p.relative_to(REPO)) for p in scanned_paths() if OCCASION_NAME.search(p.name)]
    assert not named, "named after an occasion of work (name it by what it measures or changes):\n" + "\n".join(named)


def test_no_text_names_an_occasion():
    found = [hit for path in scanned_paths() if path.is_file() for hit in occasions_in(path)]
    assert not found, "an occasion of work in the text (state the rule, or point to the benchmark):\n" + "\n".join(
        found
    )


def test_the_patterns_catch_occasions_and_spare_the_words_elsewhere():
    for text in (
        "reports/h200/README.md, session 9",
        "sessions 5-8",
        "call 4",
        "session12/call7",
        "last stop",
        "on 2026-11-29",
    ):
        assert OCCASION.search(text), text
    for text in (
        "rows.stop - rows.start",
        "start_new_session=True",
        '@pytest.fixture(scope="session")',
        "SIGSTOP",
        'H3LAB_FAULT", "stop:1"',
        "call it once",
        "a POSIX session",
    ):
        assert not OCCASION.search(text), text
    for name in ("session12-call4.sh", "gemm-session9.json", "probe3.py", "2026-11-29"):
        assert OCCASION_NAME.search(name), name
    for name in ("test_run_states.py", "layout_diagnose.py", "sm90.json"):
        assert not OCCASION_NAME.search(name), name
