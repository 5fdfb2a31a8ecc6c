"""Scripts for :class:`~nemo_gym_browser.local.scripted_policy.ScriptedPolicy` that also work in step-wise mode.

What it gives
    Step-wise walks of any length (:func:`walk`). A script keys on ``PolicyView.step``, right in either mode (a
    step-wise prompt holds only the latest steps; the count is read from its history line), so
    ``scripted_policy.steps`` (here also :func:`steps`) drives both modes side by side.
"""

from __future__ import annotations

from ..local import scripted_policy as sp

steps = sp.steps


def walk(length: int, answer: str, *, link: str = "About") -> sp.Script:
    """An episode of exactly ``length`` policy steps: observe, click ``link``, observe ... then finish."""
    if length < 1:
        raise ValueError("an episode has at least one step (the finish)")
    moves = [sp.observe() if index % 2 == 0 else sp.click_matching(link) for index in range(length - 1)]
    return steps(*moves, sp.finish(answer))
