"""Command line: ``python -m switchboard_runner new NAME [--dir DIR] [--author A] [--mode M]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .scaffold import scaffold


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchboard_runner", description="Switchboard runner tools")
    commands = parser.add_subparsers(dest="command", required=True)
    new = commands.add_parser("new", help="create a runner plugin directory (manifest.toml + runner.py)")
    new.add_argument("name", help="plugin name (part of the runner id plugin:<author>/<name>/default)")
    new.add_argument("--dir", default=".", type=Path, help="where to create the plugin directory (default: .)")
    new.add_argument("--author", default="me", help="plugin author (default: me)")
    new.add_argument("--mode", default="shared", choices=["shared", "per_run"], help="execution mode")
    new.add_argument("--python", default=None, help="interpreter the worker starts (default: this one)")
    new.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args(argv)

    try:
        plugin = scaffold(
            args.name, args.dir, author=args.author, mode=args.mode, python=args.python, force=args.force
        )
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"created {plugin}/manifest.toml and {plugin}/runner.py")
    print(f"runner id: plugin:{args.author}/{args.name}/default")
    print(f"try it:    switchboard dev --runners-dir {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
