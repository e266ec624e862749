"""The ``leangraph`` console script's entry point, outside the ``leangraph`` package.

Importing the package imports torch, which takes seconds; a Ctrl-C meanwhile would end in a
traceback, where the command line answers it in one line once a command runs
(:func:`leangraph.cli.main`). Here nothing is imported before the ``try``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Import the command line and run it on ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        :func:`leangraph.cli.main`'s exit status; 130 (one line on stderr) for a Ctrl-C
        while the import runs.
    """
    try:
        from leangraph.cli import main as run
    except KeyboardInterrupt:
        print("leangraph: error: interrupted", file=sys.stderr)
        return 130
    return run(argv)
