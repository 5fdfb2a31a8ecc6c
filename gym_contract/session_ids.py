"""How the recipe names its rollouts and environment sessions, and reading a session id back.

A rollout is ``r<row index>-<16 hex digits>`` (:func:`rollout_id`); each environment session it opens is
``<rollout id>.<attempt>.<n>`` (:func:`session_id`, ``n`` counting per client). An observer that only sees the
session id (a fault proxy, a server log) recovers the row and the attempt with :func:`parse_session_id`.
"""

from __future__ import annotations

import re
import uuid

_SESSION_ID = re.compile(r"^r(?P<index>\d+)-[0-9a-f]+\.(?P<attempt>\d+)\.\d+$")


def rollout_id(index: object) -> str:
    """A fresh id for one rollout of dataset row ``index`` (``x`` when the row has none)."""
    return f"r{'x' if index is None else index}-{uuid.uuid4().hex[:16]}"


def session_id(rollout: str, attempt: int, number: int) -> str:
    """The id of the ``number``-th session a client opened, for ``attempt`` of ``rollout``."""
    return f"{rollout}.{attempt}.{number}"


def parse_session_id(session: str | None) -> tuple[int, int] | None:
    """``(row index, attempt)`` of a session the recipe opened, from its id; None for anything else."""
    match = _SESSION_ID.match(session or "")
    return (int(match["index"]), int(match["attempt"])) if match else None
