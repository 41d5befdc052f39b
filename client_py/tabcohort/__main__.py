"""``python -m tabcohort``: the same as the ``tabcohort`` console script."""

import sys

from .cli import main

sys.exit(main())
