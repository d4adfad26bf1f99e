"""``python -m broker.service [options]``: the same as ``slicebroker serve``."""

from .app import main

raise SystemExit(main())
