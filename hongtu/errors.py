"""The one exception type for mistakes a user can fix.

Everything that validates user input (config files, graph files, command-line
overrides, resource budgets) raises :class:`UserError` with a single-line
message that says what is wrong, where, and how to fix it. The command line
prints that line to stderr and exits with code 2; library callers can catch it.
A rank started by ``hongtu train``'s own launcher leaves its line for the
launcher instead (:func:`note_rank_failure`), which prints it once for all ranks.
"""

from __future__ import annotations

import os

#: environment variable naming the folder where the ranks of ``hongtu train``'s
#: launcher note their own failures (one file per rank: exit code, then the line)
RANK_FAILURES = "HONGTU_RANK_FAILURES"


class UserError(ValueError):
    """A problem with the user's input: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # One line, always: a multi-line message would break the CLI contract.
        super().__init__(" ".join(str(message).split()))


def note_rank_failure(code: int, line: str = "") -> bool:
    """In a rank of ``hongtu train``'s launcher, note that this rank ends by its
    own error (``line``, may be empty when already printed) and exits with
    ``code``; ``False``, and nothing noted, in any other process."""
    folder = os.environ.get(RANK_FAILURES)
    if not folder:
        return False
    with open(os.path.join(folder, os.environ.get("RANK", "0")), "w") as f:
        f.write(f"{code}\n{line}")
    return True
