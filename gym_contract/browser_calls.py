"""The browser's tool-call grammar: the tool names a policy calls and what a call's arguments must be.

What this module owns
    * The names: NeMo Gym's five native tools (:data:`TOOL_NAMES`, also the server's endpoints) and the recipe's
      single ``browser`` tool (:data:`SINGLE_TOOL_NAME`) whose ``action`` is one of :data:`ACTIONS`.
    * :data:`TOOL_FUNCTIONS`: each tool's description and parameters, the one wording every schema is made from.
    * :func:`parse_tool_call`: a call's arguments checked and mapped to a native tool, or the policy error the
      model reads.

Standard library only, and it imports no other module of the recipe: the environment client, the verl tool class,
the episode and the data preparation all read the names from here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

BROWSER_OBSERVE = "browser_observe"
BROWSER_NAVIGATE = "browser_navigate"
BROWSER_CLICK = "browser_click"
BROWSER_TYPE = "browser_type"
BROWSER_FINISH = "browser_finish"
TOOL_NAMES = (BROWSER_OBSERVE, BROWSER_NAVIGATE, BROWSER_CLICK, BROWSER_TYPE, BROWSER_FINISH)
NATIVE_TOOL_ACTIONS = {name: name.removeprefix("browser_") for name in TOOL_NAMES}
ACTIONS = tuple(NATIVE_TOOL_ACTIONS.values())
TOOL_OF_ACTION = {action: name for name, action in NATIVE_TOOL_ACTIONS.items()}
SINGLE_TOOL_NAME = "browser"

_ELEMENT_ID = {"type": "integer", "description": "An element id from the last observation's ELEMENTS list."}


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }


# What each tool is told to a policy: the one wording the tool configs, verl's tool class and the rows carry.
TOOL_FUNCTIONS: dict[str, dict[str, Any]] = {
    SINGLE_TOOL_NAME: _function(
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
    ),
    BROWSER_OBSERVE: _function(
        BROWSER_OBSERVE, "Read the current page: URL, title, numbered interactive elements and text.", {}, []
    ),
    BROWSER_NAVIGATE: _function(
        BROWSER_NAVIGATE,
        "Open a URL in the browser.",
        {"url": {"type": "string", "description": "An absolute http(s) URL."}},
        ["url"],
    ),
    BROWSER_CLICK: _function(
        BROWSER_CLICK, "Click an element of the last observation.", {"element_id": _ELEMENT_ID}, ["element_id"]
    ),
    BROWSER_TYPE: _function(
        BROWSER_TYPE,
        "Type text into an element of the last observation.",
        {"element_id": _ELEMENT_ID, "text": {"type": "string", "description": "The text to enter."}},
        ["element_id", "text"],
    ),
    BROWSER_FINISH: _function(
        BROWSER_FINISH,
        "End the task with your final answer.",
        {"answer": {"type": "string", "description": "Your final answer."}},
        ["answer"],
    ),
}


def tool_function(name: str) -> dict[str, Any]:
    """A fresh copy of the function ``name`` (``browser`` or a native tool) as :data:`TOOL_FUNCTIONS` tells it."""
    if name not in TOOL_FUNCTIONS:
        raise ValueError(
            f"no browser tool is named {name!r}; expected {SINGLE_TOOL_NAME!r} or one of {list(NATIVE_TOOL_ACTIONS)}"
        )
    return json.loads(json.dumps(TOOL_FUNCTIONS[name]))


def parse_tool_call(tool_name: str, parameters: Any) -> tuple[str, dict[str, Any]] | str:
    """``(native tool, arguments)`` for a call of ``tool_name``, or the policy error to show the model.

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
    return TOOL_OF_ACTION[action], arguments
