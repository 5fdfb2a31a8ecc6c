"""Shortening text for messages, logs and records: one rule, so every cut looks the same.

``shorten`` keeps text of at most ``limit`` characters as it is and otherwise cuts it to exactly ``limit``
characters, the last of them the marker ("…" unless the caller asks otherwise).
"""

from __future__ import annotations

ELLIPSIS = "…"


def shorten(text: str, limit: int, marker: str = ELLIPSIS, *, one_line: bool = False) -> str:
    """``text`` cut to at most ``limit`` characters, ending in ``marker`` when something was cut.

    ``one_line`` first collapses every run of whitespace (newlines included) to one space, for text that
    goes on a single line of a message or a listing.
    """
    if limit < len(marker):
        raise ValueError(f"limit {limit} is shorter than the marker {marker!r}")
    if one_line:
        text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - len(marker)] + marker
