"""How a MiniWoB++ episode is graded: by nemo-gym's own ``/verify`` with ``dom_contains``, on a completion code
that the page writes only when MiniWoB scores the episode with a raw reward of 1.

:class:`GradeKey` is the site's secret: a problem's code is ``HMAC-SHA256(key, "<task>/<seed>")`` cut to
:data:`CODE_HEX_CHARS` hex digits, so it names one problem and says nothing of another's. :func:`verifier_metadata`
is the row's grade; the 0.7.0 server lower-cases both sides and looks for the code in the page title plus the body's
``inner_text``, at the ``browser_finish`` snapshot or on the live page.

The policy cannot forge it: before a success the code is only in the adapter's self-removing inline script (never
observation text), typing does not reach ``inner_text``, the site echoes no request, answering is not graded, and a
problem is dealt once per browser. A policy that solved a training problem has seen its code and could reuse it only
on a public page that prints what it asks; held-back seeds are never trained on. The argument in full:
``docs/miniwob.md``; each move is played in ``tests/test_miniwob_integration.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

KEY_BYTES = 32
# 128 bits: no policy guesses it, and it is one short word of hex in the page text.
CODE_HEX_CHARS = 32
GRADE_KEY = "dom_contains"
# Shown before the code on a success; the grade looks for the code alone.
CODE_LABEL = "Completion code"


class GradeKeyError(ValueError):
    """A key file that is missing, unreadable or not a key."""


@dataclass(frozen=True)
class GradeKey:
    """The secret that turns a task and a seed into a completion code. Its repr never shows the secret."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise GradeKeyError(f"a grade key needs at least 16 bytes, got {len(self.secret)}")

    @classmethod
    def generate(cls) -> GradeKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def load(cls, path: Path | str) -> GradeKey:
        """The key stored (as hex) in ``path``."""
        try:
            text = Path(path).read_text(encoding="ascii").strip()
            return cls(bytes.fromhex(text))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise GradeKeyError(f"{path}: not a MiniWoB grade key ({type(exc).__name__})") from None

    @classmethod
    def load_or_create(cls, path: Path | str) -> GradeKey:
        """The key in ``path``, made (readable by its owner only) when the file does not exist yet."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        key = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(key.secret.hex() + "\n")
        return key

    def completion_code(self, task: str, seed: int) -> str:
        digest = hmac.new(self.secret, f"{task}/{seed}".encode(), hashlib.sha256).hexdigest()
        return digest[:CODE_HEX_CHARS]


def verifier_metadata(key: GradeKey, task: str, seed: int) -> dict[str, str]:
    """The row's grade: the page must show this problem's completion code."""
    return {GRADE_KEY: key.completion_code(task, seed)}
