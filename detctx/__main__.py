"""``python -m detctx``: the ``detctx`` command."""

import sys

from detctx._cli import main

if __name__ == "__main__":
    sys.exit(main())
