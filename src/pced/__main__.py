"""``python -m pced``: the ``pced`` command line."""

import sys

from .cli import main

sys.exit(main())
