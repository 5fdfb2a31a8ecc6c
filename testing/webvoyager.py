"""Where the real WebVoyager files are (task list and reference answers, Apache-2.0), for tests and examples.

They are not shipped with the recipe (``docs/data.md`` says where they come from and where the tests look). The
folder holding ``WebVoyager_data.jsonl`` and ``reference_answer.json`` is ``$WEBVOYAGER_DATA_DIR`` when set, else
:data:`DEFAULT_DIR`, a folder beside the clone, never a path of one machine. A test that needs the files fails
naming that folder when they are not there.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "WEBVOYAGER_DATA_DIR"
DEFAULT_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "webvoyager"
TASKS_FILE = "WebVoyager_data.jsonl"
ANSWERS_FILE = "reference_answer.json"


def webvoyager_dir() -> Path:
    """The folder the WebVoyager files are read from: ``$WEBVOYAGER_DATA_DIR``, else :data:`DEFAULT_DIR`."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DIR)


def missing_message(folder: Path) -> str:
    """What a test says when the files are not in ``folder``."""
    return (
        f"the WebVoyager files ({TASKS_FILE}, {ANSWERS_FILE}) are missing in {folder}: download them from "
        f"github.com/MinorJerry/WebVoyager (data/) and set {DATA_DIR_ENV} to their folder (docs/data.md)"
    )
