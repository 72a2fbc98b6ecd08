"""UsageError: the one error type every launcher command raises for a mistake in what it was given;
RunFailed: a run that cannot go on (one line for the user)."""

import errno
from pathlib import Path


class UsageError(Exception):
    """A one-line error for the user; printed without a traceback, exit 2."""


class RunFailed(RuntimeError):
    pass


def cannot_write(path: Path, exc: OSError) -> str:
    """One line for a file the launcher cannot write (a full disk above all)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on {path.parent} (writing {path.name}); free space, then resume with --resume"
    return f"cannot write {path}: {exc.strerror or exc}"
