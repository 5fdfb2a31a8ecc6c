"""The row contract: what a NeMo Gym row for the ``interactive_browser`` server must carry, and why.

A row (one JSONL line) carries
    ``responses_create_params.input``  the prompt: chat messages with text content and at least one user message.
    ``initial_url``                    where the server opens the browser at seed time (a path relative to the
                                       server's folder becomes ``file://``).
    ``verifier_metadata``              optional: how ``/verify`` grades the episode. Without it only the judge can
                                       score the task. The server stores it at seed time; ``/verify`` takes no
                                       grading fields of its own.
    ``agent_ref``, task fields         optional: what NeMo Gym's own agents and this recipe's judge and logs read
                                       (``tasks.task_from_nemo_gym_row`` validates them).

What this module owns
    The one rule for ``verifier_metadata`` (:func:`validate_verifier_metadata`). Data preparation, the dataset,
    preflight and the environment client all apply it, so a row is judged the same wherever it was built. The rule
    follows what the 0.7.0 server's ``_score`` does (pinned by ``tests/test_real_server_raw.py``):
      * it tries the keys of :data:`VERIFIER_KEYS` in that order and grades only the first one present; a second
        key is ignored without a word, so a row may carry exactly one;
      * a key it does not know answers 500 at verify when alone, and is ignored when a known key is beside it;
      * it tests presence, not value: a null value counts as present (``final_url: null`` grades ``url == None``,
        always 0), an empty ``dom_contains``/``url_contains`` matches every page, a number in ``url_contains``
        fails as "browser unreachable while scoring", so values must be non-empty strings;
      * ``None`` or ``{}`` stores no spec: verify answers 500, so such a task is scored by the judge instead.

Guarantees
    A spec that passes is graded on the key it names and nothing else. Null values are dropped before that
    check (they mean "not set", and columnar datasets fill absent columns with them): send the returned mapping,
    never the input, since the server would count the nulls as keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The grading keys the 0.7.0 server knows, in the order its _score tries them; it grades the first one present.
VERIFIER_KEYS = ("answer_equals", "final_url", "url_contains", "dom_contains")
_PRECEDENCE = " > ".join(VERIFIER_KEYS)


class VerifierMetadataError(ValueError):
    """``verifier_metadata`` the server would grade wrongly or not at all. The message has no location: callers
    that read rows from a file prefix their own (``file:line``)."""


def validate_verifier_metadata(value: Any) -> dict[str, str] | None:
    """The grading spec as the server should receive it, or None for a task without one (the judge grades it).

    ``None``, ``{}`` and a mapping of nulls only mean no spec. Otherwise exactly one key of :data:`VERIFIER_KEYS`
    with a non-empty string value; anything else raises :class:`VerifierMetadataError`.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise VerifierMetadataError(f"verifier_metadata must be an object, got {type(value).__name__}")
    spec = {key: val for key, val in value.items() if val is not None}
    if not spec:
        return None
    unknown = sorted(str(key) for key in spec if key not in VERIFIER_KEYS)
    if unknown:
        raise VerifierMetadataError(
            f"unknown verifier_metadata keys {unknown}: the server knows {list(VERIFIER_KEYS)}; it answers 500 at "
            "verify for an unknown key alone and ignores one next to a known key"
        )
    if len(spec) > 1:
        keys = [key for key in VERIFIER_KEYS if key in spec]
        raise VerifierMetadataError(
            f"verifier_metadata has {len(keys)} grading keys {keys}, but the server grades only one: the first "
            f"present in the order {_PRECEDENCE}, here {keys[0]!r}, ignoring the rest. Keep exactly one"
        )
    ((key, val),) = spec.items()
    if not isinstance(val, str) or not val.strip():
        raise VerifierMetadataError(f"verifier_metadata[{key!r}] must be a non-empty string, got {val!r}")
    return {key: val}
