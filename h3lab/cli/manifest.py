"""`h3lab manifest PATH [--out FILE]`: pin an existing checkpoint folder with sha256 hashes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from h3lab.io.manifest import manifest_changes, manifest_path, write_manifest
from h3lab.io.rundir import read_record


def add_arguments(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("path", help="checkpoint folder (diffusers layout, or a repo folder holding transformer/)")
    parser.add_argument("--out", default=None, help="file to write (default: manifest.json beside the weights)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace a manifest whose pins no longer match the files (prints what changed)",
    )

    def run(args: argparse.Namespace) -> int:
        target = manifest_path(args.path, args.out)
        replaced, before = target.is_file(), read_record(target) or {}  # {}: an unreadable manifest
        out = write_manifest(args.path, args.out, force=args.force)
        manifest = json.loads(out.read_text())
        if replaced and args.force:
            for change in manifest_changes(before, manifest) or ["nothing changed"]:
                print(f"re-pinned: {change}")
        size = sum(entry["size"] for entry in manifest["files"].values())
        print(f"{out}: {len(manifest['files'])} files ({size / 1e6:.1f} MB), {len(manifest['tensors'])} tensors pinned")
        return 0

    return run
