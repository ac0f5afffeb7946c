"""`h3lab manifest PATH [--out FILE]`: pin an existing checkpoint folder with sha256 hashes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from h3lab.io.manifest import manifest_changes, manifest_path, write_manifest


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
        try:
            before = json.loads(target.read_text()) if target.is_file() else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            before = {}
        out = write_manifest(args.path, args.out, force=args.force)
        manifest = json.loads(out.read_text())
        if before is not None and args.force:
            changes = manifest_changes(before if isinstance(before, dict) else {}, manifest)
            for change in changes:
                print(f"re-pinned: {change}")
            if not changes:
                print("re-pinned: nothing changed")
        size = sum(entry["size"] for entry in manifest["files"].values())
        print(f"{out}: {len(manifest['files'])} files ({size / 1e6:.1f} MB), {len(manifest['tensors'])} tensors pinned")
        return 0

    return run
