"""The `h3lab` command line. Every subcommand is a thin call into the library."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command, str]] = {}


def command(name: str, help: str) -> Callable[[Callable[[argparse.ArgumentParser], None]], Callable]:
    """Register `h3lab <name>`: the decorated function adds arguments and returns the handler."""

    def register(add_args: Callable[[argparse.ArgumentParser], Command]) -> Callable:
        _COMMANDS[name] = (add_args, None, help)  # type: ignore[assignment]
        return add_args

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3lab", description="Bitwise, layout-invariant MiniMax-H3 block.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _, help_text) in sorted(_COMMANDS.items()):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=add_args(p))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from h3lab import commands  # noqa: F401  (registers the subcommands)

    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so `finally` blocks kill launched workers and runs are marked interrupted
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return int(args.handler(args) or 0)
    except ValueError as err:  # a caller error: one clear line, no traceback
        print(f"h3lab {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
