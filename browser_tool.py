"""The browser as a verl tool: its names and schemas, a tool call's arguments, and the text the model reads back.

What this module owns
    * :class:`BrowserTool` (a verl ``BaseTool``): a tool call becomes a browser action on the rollout's own
      session. One class serves the recipe's single ``browser`` tool (``action`` = observe / navigate / click /
      type / finish) and NeMo Gym's five native tools (``browser_observe`` ... ``browser_finish``); the tool
      name in the tool config decides which (``configs/browser_tool.yaml``, ``configs/browser_native_tools.yaml``).
    * :func:`parse_tool_call`: a call's arguments checked and mapped to an environment tool, or the policy error
      the model reads; :func:`render_result`: the text of one browser answer.

Lifetimes
    verl creates and releases a tool instance around every single call and turns every tool exception into a
    chat message, so the browser session cannot belong to the tool. It belongs to the agent loop's attempt
    (:class:`~nemo_gym_browser.episode.BrowserEpisode`), which the loop hangs on verl's ``AgentData`` under
    :data:`EPISODE_ATTRIBUTE` for the attempt's lifetime; the tool finds it there (:func:`episode_of`), never
    through ``request_id``, which verl makes ``det-<priority>`` under ``full_determinism``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from .environment import ToolResult

if TYPE_CHECKING:
    from .episode import BrowserEpisode

# The agent loop that owns the tool's session (registered through configs/agent_loop.yaml).
AGENT_LOOP_NAME = "nemo_gym_browser_agent"
# Where the attempt's episode hangs on verl's AgentData (verl itself adds private attributes there too).
EPISODE_ATTRIBUTE = "nemo_gym_browser_episode"

ACTIONS = ("observe", "navigate", "click", "type", "finish")
NATIVE_TOOL_ACTIONS = {f"browser_{action}": action for action in ACTIONS}
SINGLE_TOOL_NAME = "browser"
_ELEMENT_ID = {"type": "integer", "description": "An element id from the last observation's ELEMENTS list."}


def parse_tool_call(tool_name: str, parameters: Any) -> tuple[str, dict[str, Any]] | str:
    """``(environment tool, arguments)`` for a call of ``tool_name``, or the policy error to show the model.

    The single ``browser`` tool is validated here (its schema is ours); native tools are forwarded verbatim so
    the server's own validation (422) speaks, as in NeMo Gym's evaluation.
    """
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError:
            return "the arguments must be a JSON object"
    if not isinstance(parameters, Mapping):
        return "the arguments must be a JSON object"
    if tool_name in NATIVE_TOOL_ACTIONS:
        return tool_name, dict(parameters)
    action = parameters.get("action")
    if not isinstance(action, str) or action.strip().lower() not in ACTIONS:
        return f"unknown action {action!r}; the browser tool's action is one of {', '.join(ACTIONS)}"
    action = action.strip().lower()
    arguments: dict[str, Any] = {}
    if action == "navigate":
        url = parameters.get("url")
        if not isinstance(url, str) or not url.strip():
            return "navigate needs a url (a string)"
        arguments["url"] = url.strip()
    if action in ("click", "type"):
        element_id = parameters.get("element_id")
        if isinstance(element_id, str) and element_id.strip().isdigit():
            element_id = int(element_id)
        if isinstance(element_id, float) and element_id.is_integer():
            element_id = int(element_id)
        if not isinstance(element_id, int) or isinstance(element_id, bool) or element_id < 0:
            return f"{action} needs an element_id (a number from the last observation's element list)"
        arguments["element_id"] = element_id
    if action == "type":
        text = parameters.get("text")
        if not isinstance(text, str):
            return "type needs a text (a string)"
        arguments["text"] = text
    if action == "finish":
        answer = parameters.get("answer")
        if answer is None:
            return "finish needs an answer (a string)"
        arguments["answer"] = answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)
    return f"browser_{action}", arguments


def render_result(result: ToolResult) -> str:
    """The text the model reads for one browser answer."""
    if result.error:
        return f"Error: {result.error}" + (f"\n{result.observation}" if result.observation else "")
    if result.done:
        return result.observation or "Finished: your answer was recorded."
    return result.observation or "(the browser returned no observation)"


def episode_of(agent_data: Any) -> BrowserEpisode | None:
    """The attempt's episode the loop attached to verl's ``AgentData`` (None outside the browser loop)."""
    return getattr(agent_data, EPISODE_ATTRIBUTE, None)


def _schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required},
            },
        }
    )


def default_tool_schema(name: str) -> OpenAIFunctionToolSchema:
    """The schema the recipe's configs expose for ``name`` (``browser`` or one of the five native tools)."""
    if name == SINGLE_TOOL_NAME:
        return _schema(
            SINGLE_TOOL_NAME,
            "Act in a web browser. observe: read the current page (URL, title, numbered elements, text). "
            "navigate: open a url. click: click an element by id. type: type text into an element by id. "
            "finish: end the task with your answer.",
            {
                "action": {"type": "string", "enum": list(ACTIONS), "description": "What to do."},
                "url": {"type": "string", "description": "For navigate: an absolute http(s) URL."},
                "element_id": {
                    "type": "integer",
                    "description": "For click and type: an element id from the last observation's ELEMENTS list.",
                },
                "text": {"type": "string", "description": "For type: the text to enter."},
                "answer": {"type": "string", "description": "For finish: your final answer."},
            },
            ["action"],
        )
    natives = {
        "browser_observe": ("Read the current page: URL, title, numbered interactive elements and text.", {}, []),
        "browser_navigate": (
            "Open a URL in the browser.",
            {"url": {"type": "string", "description": "An absolute http(s) URL."}},
            ["url"],
        ),
        "browser_click": ("Click an element of the last observation.", {"element_id": _ELEMENT_ID}, ["element_id"]),
        "browser_type": (
            "Type text into an element of the last observation.",
            {"element_id": _ELEMENT_ID, "text": {"type": "string", "description": "The text to enter."}},
            ["element_id", "text"],
        ),
        "browser_finish": (
            "End the task with your final answer.",
            {"answer": {"type": "string", "description": "Your final answer."}},
            ["answer"],
        ),
    }
    if name not in natives:
        raise ValueError(f"no browser tool is named {name!r}; expected {SINGLE_TOOL_NAME!r} or one of {list(natives)}")
    description, properties, required = natives[name]
    return _schema(name, description, properties, required)


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
