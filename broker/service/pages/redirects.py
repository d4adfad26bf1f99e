"""Where a login may send the browser next: only to a page of this service.

A ``next`` target is taken only as a canonical path under the service's base
URL. Browsers read far more as "another site" than a leading ``//``: a
backslash counts as a slash (``/\\evil.example``), tabs and newlines are
dropped (``/<TAB>/evil.example``), and a proxy or a second decoder may undo
percent-encodings (``/%2F%2Fevil.example``). So the target is checked as sent
and after decoding, and refused for any of these, or for anything that is not
a plain path.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote

#: How many rounds of percent-decoding a target is checked after (``%25`` nests).
DECODE_ROUNDS = 4


def is_local_target(target: str, base: str) -> bool:
    """Whether ``target`` is a path of this service under ``base`` (which ends in ``/``).

    Refused: a scheme or a host; a backslash, a control, format or whitespace
    character (as sent or once decoded); an empty, ``.`` or ``..`` path segment;
    a path outside ``base``.
    """
    seen = target
    for _ in range(DECODE_ROUNDS):
        if not _is_plain_path(seen, base):
            return False
        decoded = unquote(seen)
        if decoded == seen:
            return True
        seen = decoded
    return False  # still encoded after every round: nobody sends that by mistake


def _is_plain_path(text: str, base: str) -> bool:
    """Whether ``text`` is a path under ``base`` (which starts with ``/``, so no scheme or
    host can come first) of plain segments, with no character a browser reads oddly."""
    if not text.startswith(base):
        return False
    if any(char == "\\" or unicodedata.category(char)[0] in "CZ" for char in text):
        return False
    segments = re.split("[?#]", text, maxsplit=1)[0].split("/")[1:]
    # Only the last segment may be empty: a trailing slash, as the base itself has.
    if any(segment in ("", ".", "..") for segment in segments[:-1]):
        return False
    return segments[-1] not in (".", "..")
