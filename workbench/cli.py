"""The `workbench` command line."""
from __future__ import annotations

import argparse
import sys


def _info(args: argparse.Namespace) -> int:
    """Prints the platform the workbench runs on: what every recorded result is stamped with."""
    from workbench.provenance import provenance

    for key, value in provenance().items():
        print(f"{key:>12}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Post-mortem workbench for silent numerical bugs in packed (varlen/THD) attention.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    info = commands.add_parser("info", help="versions, device and interpreter mode of this machine")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
