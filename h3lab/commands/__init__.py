"""CLI subcommands, one module each; importing this package registers them with h3lab.cli."""

from h3lab.commands import manifest, report, reproduce, run, verify, workbench  # noqa: F401
