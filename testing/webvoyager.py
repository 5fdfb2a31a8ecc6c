"""Where the real WebVoyager files are (task list and reference answers, Apache-2.0), for tests and examples.

They are not shipped with the recipe. Looked up in order: ``$WEBVOYAGER_DATA_DIR``, ``shared/data/webvoyager``
beside the recipe folder, then ``/work/shared/data/webvoyager``.
"""

from __future__ import annotations

import os
from pathlib import Path

_RECIPE_DIR = Path(__file__).resolve().parent.parent
_CANDIDATES = (_RECIPE_DIR.parent / "shared" / "data" / "webvoyager", Path("/work/shared/data/webvoyager"))


def webvoyager_dir() -> Path:
    """The folder holding ``WebVoyager_data.jsonl`` (the first candidate that has it; else the first candidate)."""
    if os.environ.get("WEBVOYAGER_DATA_DIR"):
        return Path(os.environ["WEBVOYAGER_DATA_DIR"])
    for candidate in _CANDIDATES:
        if (candidate / "WebVoyager_data.jsonl").is_file():
            return candidate
    return _CANDIDATES[0]
