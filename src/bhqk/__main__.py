"""``python -m bhqk`` is the ``bhqk`` command."""

import sys

from .cli import main

sys.exit(main())
