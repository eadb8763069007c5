"""``python -m quilt_bench ...``: the ``quilt-bench`` command line (see ``quilt_bench.cli``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
