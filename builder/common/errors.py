"""The project's two kinds of failure, and the exit codes the CLI gives them.

- :class:`InputError`: bad input (a flag, a file, a setting). The message names where
  (``file:line:col``, ``--flag`` or ``VARIABLE``), what is wrong and what would be right.
  Exit 2, nothing half-done.
- :class:`StepFailed`: a step that ran and failed (the engine refused, a build broke).
  Exit 1.

Anything else that escapes is a bug and gets a traceback. Only ``builder.cli.main``
maps these to exit codes; domain code raises them and never calls ``sys.exit``.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


class InputError(Exception):
    """Bad input: exit 2. ``lines`` are printed one per line on stderr."""

    def __init__(self, *lines: str) -> None:
        self.lines: tuple[str, ...] = tuple(lines) or ("invalid input",)
        super().__init__("\n".join(self.lines))


class StepFailed(Exception):
    """A step failed for a reason outside the input: exit 1."""
