"""The `h3lab` command line: one module per subcommand, each a thin call into the library.

A subcommand module defines `add_arguments(parser) -> handler`; the handler takes the parsed
arguments and returns the exit status. `COMMANDS` is the whole registry, as data: a module is
imported only when its command runs (or when the parser is built), and no module here imports
this package back.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Subcommand(NamedTuple):
    module: str
    help: str


COMMANDS: dict[str, Subcommand] = {
    "accuracy": Subcommand(
        "h3lab.cli.accuracy",
        "one block: the canonical block against the FP64 oracle and diffusers (a synthetic or given checkpoint)",
    ),
    "compare": Subcommand(
        "h3lab.cli.compare",
        "run your own script (h3lab.parallelize, h3lab.record) under each layout and compare its records byte "
        "for byte with one process",
    ),
    "manifest": Subcommand(
        "h3lab.cli.manifest", "write manifest.json (sha256 of every file and tensor) for a checkpoint folder"
    ),
    "publish": Subcommand(
        "h3lab.cli.publish",
        "regenerate reports/<node type>[x<GPUs>]/: sweeps through papermill, the benchmarks, the report",
    ),
    "report": Subcommand(
        "h3lab.cli.report", "render run directories into a self-contained HTML report (reports/<node type>/)"
    ),
    "run": Subcommand("h3lab.cli.run", "run layouts on N processes and compare every byte with the canonical block"),
    "verify": Subcommand(
        "h3lab.cli.verify",
        "recompute the golden digests of the reference problems and compare with the set published for this "
        "backend and GPU architecture",
    ),
    "workbench": Subcommand(
        "h3lab.cli.workbench", "execute a notebook (reproduce, explore) through papermill into a run directory"
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (imports each subcommand's module)."""
    parser = argparse.ArgumentParser(prog="h3lab", description="Bitwise, layout-invariant MiniMax-H3 block.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        p.set_defaults(handler=importlib.import_module(cmd.module).add_arguments(p))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `h3lab ARGV`; a caller error (ValueError) is one line on stderr and exit status 2, an
    error of the machine (OSError: a full disk, a lost mount) one line and exit status 1, Ctrl-C
    one line and exit status 130 (128 + SIGINT), once the command has ended what it started."""
    # SIGTERM and SIGHUP (a closed terminal) unwind like Ctrl-C: `finally` blocks kill launched
    # workers and runs are marked interrupted
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    command = "h3lab"
    try:
        args = build_parser().parse_args(argv)
        command = f"h3lab {args.command}"
        return int(args.handler(args) or 0)
    except ValueError as err:  # a caller error: one clear line, no traceback
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"{command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the command's own handlers have written its final state
        print(f"{command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
