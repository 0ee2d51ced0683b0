"""The one exception type for mistakes a user can fix.

Everything that validates user input (config files, graph files, command-line
overrides, resource budgets) raises :class:`UserError` with a single-line
message that says what is wrong, where, and how to fix it. The command line
prints that line to stderr and exits with code 2; library callers can catch it.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # One line, always: a multi-line message would break the CLI contract.
        super().__init__(" ".join(str(message).split()))
