"""`python -m kvjax <command>`: the kvjax command line.

Each subcommand lives in its own module, which provides
`add_parser(subparsers)`: it registers the subcommand's parser and sets the
`func` default to a callable taking the parsed namespace and returning an exit
status. Keep those modules light at import time (import JAX inside `func`), so
that `--help` stays fast.
"""

import argparse
import sys
from collections.abc import Sequence

from kvjax import demo as demo_cli
from kvjax import eval as eval_cli
from kvjax import info as info_cli
from kvjax.generate import cli as generate_cli
from kvjax.memory import cli as memory_cli
from kvjax.serve import cli as serve_cli

# Append a module here to add a subcommand (generate, demo, eval, ...).
SUBCOMMANDS = (memory_cli, generate_cli, serve_cli, demo_cli, eval_cli, info_cli)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand in `SUBCOMMANDS` registered."""
    parser = argparse.ArgumentParser(
        prog="python -m kvjax",
        description="kvjax: paged, shared, quantized, sparse and sharded KV caches for JAX.",
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True,
        help="run 'python -m kvjax COMMAND --help' for the options of one command",
    )
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses `argv` (default: `sys.argv[1:]`), runs the chosen subcommand, returns its status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
