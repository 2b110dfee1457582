"""``python -m aiokv.bench``: see :mod:`aiokv.bench`."""

from . import main

raise SystemExit(main())
