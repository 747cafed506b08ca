"""``python -m dsv4ray``: the command line (``dsv4ray.entrypoints.cli``)."""

import sys

from dsv4ray.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
