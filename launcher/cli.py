"""`launcher`: up, status, down, probe (and units, keys, export, report, eval, regenerate).

The launcher never imports torch: it starts fast, stays small, and can never hold GPU memory.
Exit codes of `up`: 0 training finished, 1 failed, 2 bad usage or config, 3 stopped before the end.

Where each part lives: parser.py (the commands and their options), up.py, status.py, down.py,
commands.py (the others), rundir.py (what a run folder records, runs/latest), inputs.py (the
model, the data and the demo, checked before any worker starts).
"""
from __future__ import annotations

import sys

from launcher.errors import UsageError
from launcher.parser import build_parser
from launcher.supervisor import EXIT_USAGE
from launcher.topology import SpecError
from services.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv             # for the resume hint of `up`
    try:
        return args.func(args)
    except (UsageError, SpecError, ConfigError) as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
