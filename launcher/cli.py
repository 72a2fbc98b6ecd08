"""`launcher`: up, status, down, probe (and units, keys, export, report, eval, regenerate).

The launcher never imports torch: it starts fast, stays small, and can never hold GPU memory.
Exit codes of `up`: 0 training finished, 1 failed, 2 bad usage or config, 3 stopped before the end.
A closed stdout (`launcher status | head -1`) ends any command quietly with 141, the shell's code
for a pipe closed under it (128 + SIGPIPE), and no traceback.

Where each part lives: parser.py (the commands and their options), up.py, status.py, down.py,
commands.py (the others), rundir.py (what a run folder records, runs/latest), inputs.py (the
model, the data and the demo, checked before any worker starts).
"""

from __future__ import annotations

import os
import sys

from launcher.errors import UsageError
from launcher.parser import build_parser
from launcher.supervisor import EXIT_USAGE
from launcher.topology import GpuSpecError
from services.run.config import ConfigError

EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a pipe's block buffer is written here, inside the try, not at exit
        return code
    except BrokenPipeError:
        # the reader (head, less) closed the pipe: stop quietly. Point stdout at devnull, so the
        # interpreter's flush at exit does not raise the same error again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_PIPE


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # for the resume hint of `up`
    try:
        return args.func(args)
    except (UsageError, GpuSpecError, ConfigError) as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
