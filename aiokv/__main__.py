"""``python -m aiokv``: the ``aiokv`` command."""

import sys

from .cli import main

sys.exit(main())
