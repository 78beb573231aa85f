"""Errors the user can fix. The CLI prints their message (no traceback) and exits 2."""


class UsageError(Exception):
    """Bad input from the user: the message names the bad value and the fix."""
