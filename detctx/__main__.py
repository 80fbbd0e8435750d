"""``python -m detctx``: the ``detctx`` command."""

import sys

from detctx.cli import main

if __name__ == "__main__":
    sys.exit(main())
