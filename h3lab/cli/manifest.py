"""`h3lab manifest PATH [--out FILE]`: pin an existing checkpoint folder with sha256 hashes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from h3lab.io.manifest import write_manifest


def add_arguments(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("path", help="checkpoint folder (diffusers layout, or a repo folder holding transformer/)")
    parser.add_argument("--out", default=None, help="file to write (default: manifest.json beside the weights)")

    def run(args: argparse.Namespace) -> int:
        out = write_manifest(args.path, args.out)
        manifest = json.loads(out.read_text())
        size = sum(entry["size"] for entry in manifest["files"].values())
        print(f"{out}: {len(manifest['files'])} files ({size / 1e6:.1f} MB), {len(manifest['tensors'])} tensors pinned")
        return 0

    return run
