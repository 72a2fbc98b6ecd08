"""UsageError: the one error type every launcher command raises for a mistake in what it was given."""


class UsageError(Exception):
    """A one-line error for the user; printed without a traceback, exit 2."""
