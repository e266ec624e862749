"""``python -m leangraph``: the ``leangraph`` command line."""

from __future__ import annotations

import sys

from leangraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
