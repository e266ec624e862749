"""The tools around the library: the ``leangraph`` command line and what it runs.

``commands`` parses the command line; ``demo`` and ``bench`` are its ``demo`` and ``bench``
commands as functions; ``workloads`` builds their transformer blocks; ``local_pipeline`` runs
a pipeline order in one process. All of them use only leangraph's public API.
"""

from __future__ import annotations

from .commands import build_parser, main, progress_bar

__all__ = ["build_parser", "main", "progress_bar"]
