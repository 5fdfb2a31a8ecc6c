"""Scripts for :class:`~nemo_gym_browser.local.scripted_policy.ScriptedPolicy` that also work in step-wise mode.

What it gives
    A script of ``scripted_policy`` picks its next turn by ``PolicyView.turn`` (assistant turns already in the
    conversation). A step-wise prompt holds only the latest steps, so that count stops growing; the step number
    is then read from the prompt's history line (``STEP_HISTORY_HEADER`` of ``browser_agent_loop``). The
    scripts here use :func:`step_number`, which is right in both modes, so one script drives both side by side.
"""

from __future__ import annotations

import re

from ..local import scripted_policy as sp
from ..stepwise import STEP_HISTORY_HEADER

_HISTORY = re.compile(re.escape(STEP_HISTORY_HEADER).replace(re.escape("{steps}"), r"(\d+)"))


def step_number(view: sp.PolicyView) -> int:
    """Policy steps already taken in the episode (0 on its first generation), in either mode."""
    match = _HISTORY.search(view.text)
    return int(match.group(1)) if match else view.turn


def steps(*sequence: sp.Step, then: str = "I am done.") -> sp.Script:
    """``scripted_policy.steps`` keyed on :func:`step_number`: one step of ``sequence`` per policy step."""

    def script(view: sp.PolicyView) -> str:
        number = step_number(view)
        return sequence[number](view) if number < len(sequence) else then

    return script


def walk(length: int, answer: str, *, link: str = "About") -> sp.Script:
    """An episode of exactly ``length`` policy steps: observe, click ``link``, observe ... then finish."""
    if length < 1:
        raise ValueError("an episode has at least one step (the finish)")
    moves = [sp.observe() if index % 2 == 0 else sp.click_matching(link) for index in range(length - 1)]
    return steps(*moves, sp.finish(answer))
