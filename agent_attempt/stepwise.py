"""Step-wise mode: the prompt of one policy step, rebuilt from the task and a bounded history of earlier steps.

Contract: :func:`step_messages` is a step's prompt: the row's system and user messages, one user message with a
line per earlier step (:func:`step_summary`: action, arguments, result, page; the newest ``history_steps``, older
ones only counted) and the latest ``history_observations`` steps whole. verl's prompt builder renders it afresh each
step, so tokens per sample do not grow with the episode. The loop runs the steps with the default mode's code and
returns the final attempt's step samples, each with the episode's reward and flags plus ``env_step``/``env_steps``.

Errors: step-wise mode needs the V1 trainer (one sample per step); this module holds the messages that refuse it
elsewhere, at construction and in ``run`` without the V1 worker's ``session_id``. How GRPO weighs steps, and when to
use the mode: ``docs/agent-loop.md#step-wise-mode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall

from ..gym_contract.environment import parse_observation
from ..settings import StepwiseSettings
from .episode import Step

LEGACY_STEPWISE_MESSAGE = (
    "step-wise mode (stepwise.enabled: true) returns one sample per policy step, which only verl's V1 trainer "
    "accepts (trainer.use_v1=true); the legacy trainer needs exactly one sample per prompt. Use the V1 trainer or "
    "set stepwise.enabled=false"
)
UNBOUNDED_STEPWISE_MESSAGE = (
    "step-wise mode (stepwise.enabled: true) needs actor_rollout_ref.rollout.multi_turn.max_assistant_turns: each "
    "step's prompt is bounded, so the response length cannot end an episode and only the wall-clock deadline would"
)
# The first line of a step-wise prompt's history message (test policies read the step number from it).
STEP_HISTORY_HEADER = "Progress so far: {steps} step(s) taken in this episode."


@dataclass
class StepRecord:
    """One policy step of a step-wise episode, as later steps' prompts show it."""

    assistant_text: str  # the model's turn, tool calls included, as it generated it
    results: list[str]  # the tool messages it read back
    summary: str  # the one line shown once the step has left the latest ``history_observations``


def step_messages(
    task_messages: list[dict[str, Any]], history: list[StepRecord], settings: StepwiseSettings
) -> list[dict[str, Any]]:
    """One step's prompt: the task, one line per earlier step (at most ``history_steps``), then the latest
    ``history_observations`` steps whole (the model's turn and the tool results it read)."""
    if not history:
        return list(task_messages)
    recent = history[-settings.history_observations :]
    earlier = history[: len(history) - len(recent)]
    shown = earlier[len(earlier) - settings.history_steps :] if settings.history_steps else []
    lines = [STEP_HISTORY_HEADER.format(steps=len(history))]
    if len(earlier) > len(shown):
        lines.append(f"(steps 1-{len(earlier) - len(shown)} are not shown)")
    first = len(earlier) - len(shown) + 1
    lines.extend(f"Step {first + offset}: {record.summary}" for offset, record in enumerate(shown))
    lines.append(f"The latest {len(recent)} step(s) follow in full.")
    messages = [*task_messages, {"role": "user", "content": "\n".join(lines)}]
    for record in recent:
        messages.append({"role": "assistant", "content": record.assistant_text})
        messages.extend({"role": "tool", "content": result} for result in record.results)
    return messages


def step_summary(recorded: Sequence[Step], calls: list[FunctionCall], results: list[str]) -> str:
    """One line for a step: what the episode recorded of its actions (else the calls themselves) and where it
    left the page."""
    if recorded:
        line = "; ".join(str(step) for step in recorded)
    else:
        line = "; ".join(
            f"{call.name}({call.arguments[:80]}) -> {result.splitlines()[0][:120] if result else ''}"
            for call, result in zip(calls, results, strict=False)
        )
    url, title, _ = parse_observation(results[-1] if results else None)
    if url or title:
        line += f" [page: {title or ''} {url or ''}]".replace("  ", " ")
    return line
