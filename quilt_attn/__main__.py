"""``python -m quilt_attn ...``: the ``quilt-attn`` command line (see ``quilt_attn.cli``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
