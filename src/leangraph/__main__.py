"""``python -m leangraph``: the ``leangraph`` command line.

The package imports nothing heavy (its names are imported at first use), so the console
script's entry, which imports the command line (and torch) inside its own ``try``, answers a
Ctrl-C during that import here too.
"""

from __future__ import annotations

import sys

from _leangraph_entry import main

if __name__ == "__main__":
    sys.exit(main())
