"""The browser as a verl tool: its schemas, and where a call finds the rollout's browser session.

What this module owns
    * :class:`BrowserTool` (a verl ``BaseTool``): a tool call becomes a browser action on the rollout's own
      session. One class serves the recipe's single ``browser`` tool (``action`` = observe / navigate / click /
      type / finish) and NeMo Gym's five native tools (``browser_observe`` ... ``browser_finish``); the tool
      name in the tool config decides which (``configs/browser_tool.yaml``, ``configs/browser_native_tools.yaml``).
      The names and the grammar of a call's arguments are :mod:`~nemo_gym_browser.gym_contract.browser_calls`'.
    * :func:`default_tool_schema`: the schema each name gets when the tool config gives none.

Lifetimes
    verl creates and releases a tool instance around every single call and turns every tool exception into a
    chat message, so the browser session cannot belong to the tool. It belongs to the agent loop's attempt
    (:class:`~nemo_gym_browser.agent_attempt.episode.BrowserEpisode`), which the loop hangs on verl's ``AgentData``
    under :data:`EPISODE_ATTRIBUTE` for the attempt's lifetime; the tool finds it there (:func:`episode_of`), never
    through ``request_id``, which verl makes ``det-<priority>`` under ``full_determinism``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from ..gym_contract.browser_calls import NATIVE_TOOL_ACTIONS, SINGLE_TOOL_NAME, tool_function

if TYPE_CHECKING:
    from .episode import BrowserEpisode

# The agent loop that owns the tool's session (registered through configs/agent_loop.yaml).
AGENT_LOOP_NAME = "nemo_gym_browser_agent"
# Where the attempt's episode hangs on verl's AgentData (verl itself adds private attributes there too).
EPISODE_ATTRIBUTE = "nemo_gym_browser_episode"


def episode_of(agent_data: Any) -> BrowserEpisode | None:
    """The attempt's episode the loop attached to verl's ``AgentData`` (None outside the browser loop)."""
    return getattr(agent_data, EPISODE_ATTRIBUTE, None)


def default_tool_schema(name: str) -> OpenAIFunctionToolSchema:
    """The schema the recipe's configs expose for ``name`` (``browser`` or one of the five native tools)."""
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": tool_function(name)})


class BrowserTool(BaseTool):
    """A browser action on the rollout's own session (see the module docstring).

    Tool config (``configs/browser_tool.yaml``, ``configs/browser_native_tools.yaml``)::

        tools:
          - class_name: nemo_gym_browser.browser_agent_loop.BrowserTool
            config: {type: native, name: browser}     # name used when tool_schema is omitted
            tool_schema: {...}                         # optional; the schema's name decides the interface

    It only works inside :class:`BrowserToolAgentLoop`, which owns the session.
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        name = (tool_schema.function.name if tool_schema else None) or (config or {}).get("name") or SINGLE_TOOL_NAME
        if name != SINGLE_TOOL_NAME and name not in NATIVE_TOOL_ACTIONS:
            raise ValueError(
                f"BrowserTool cannot be named {name!r}: use {SINGLE_TOOL_NAME!r} or one of {list(NATIVE_TOOL_ACTIONS)}"
            )
        super().__init__(config or {}, tool_schema or default_tool_schema(name))

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        # Nothing per call: the session lives on the loop's episode, found through agent_data in execute.
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        episode = episode_of(kwargs.get("agent_data"))
        if episode is None:
            raise RuntimeError(
                f"the {self.name} tool has no browser session: it only runs inside BrowserToolAgentLoop "
                f"(agent_name {AGENT_LOOP_NAME!r}, registered by configs/agent_loop.yaml)"
            )
        return ToolResponse(text=await episode.act(self.name, parameters)), 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None
