"""``python -m broker.service.openapi [--markdown]``: print the broker's OpenAPI
document (JSON), or the API reference (``docs/api.md``).

The command, unlike the document builder, needs the whole service (the handler
list and the application's options), so it lives here, where nothing imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..apihandlers import default_handlers
from ..app import BrokerApp
from . import build_document, markdown


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m broker.service.openapi",
        description="Print the broker's OpenAPI document (JSON), or the API reference.",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the Markdown reference (docs/api.md)"
    )
    args = parser.parse_args(argv)
    document = build_document(default_handlers)
    if args.markdown:
        sys.stdout.write(markdown(document, BrokerApp))
    else:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
