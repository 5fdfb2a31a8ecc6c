"""The NeMo Gym row this recipe writes for a task: the prompt, the tool schemas it teaches, the task fields.

Two tool interfaces (``--tool-interface`` of ``prepare_webvoyager_data.py``): ``browser``, one tool with an
``action`` (the recipe's default), and ``native``, NeMo Gym's five ``browser_*`` tools (such rows also run in NeMo
Gym's own agent). A row records its interface as the tools in ``responses_create_params.tools``
(:func:`tool_interface_of`). A task that came in as a NeMo Gym row keeps everything it had.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..gym_contract.browser_calls import SINGLE_TOOL_NAME, TOOL_NAMES, tool_function
from .tasks import REFERENCE_FIELDS, Task

DATA_SOURCE = "webvoyager"  # the rows' data_source: verl keys validation metrics by it (val-core/<source>/...)
TOOL_INTERFACES = ("browser", "native")

SYSTEM_PROMPT_BROWSER = """\
You are a web agent. You operate a real web browser through the `browser` tool to complete the user's task.

Each call to `browser` takes an `action`:
- observe: show the current page: its URL, title, a numbered list of interactive elements as `[id] tag: name`, \
and the page text.
- navigate: open `url`.
- click: click the element `element_id`.
- type: type `text` into the element `element_id`.
- finish: end the task and report `answer`.

Rules:
1. The browser is already open on the start page, but you have not seen it yet: your first call is observe.
2. Element ids come from the latest observation only. After navigate, click or type the page may change: \
observe again before you use an id.
3. Make one tool call at a time and read its result before the next.
4. When you are done, call finish exactly once with the answer to the task: the facts asked for, stated fully \
and briefly. If the task asks you to do something on the site, say what you did and what you found."""

SYSTEM_PROMPT_NATIVE = """\
You are a web agent. You operate a real web browser through tools to complete the user's task.

Tools:
- browser_observe(): show the current page: its URL, title, a numbered list of interactive elements as \
`[id] tag: name`, and the page text.
- browser_navigate(url): open a URL.
- browser_click(element_id): click an element.
- browser_type(element_id, text): type text into an element.
- browser_finish(answer): end the task and report your answer.

Rules:
1. The browser is already open on the start page, but you have not seen it yet: your first call is \
browser_observe.
2. Element ids come from the latest observation only. After navigating, clicking or typing the page may change: \
observe again before you use an id.
3. Make one tool call at a time and read its result before the next.
4. When you are done, call browser_finish exactly once with the answer to the task: the facts asked for, stated \
fully and briefly. If the task asks you to do something on the site, say what you did and what you found."""

USER_PROMPT = "Task: {question}\n\nWebsite: {site}. The browser is open at {url}"


def _function_tool(name: str) -> dict[str, Any]:
    """A Responses-API function tool, the shape NeMo Gym rows carry in ``responses_create_params.tools``."""
    return {"type": "function", **tool_function(name)}


BROWSER_TOOL_SCHEMAS = [_function_tool(SINGLE_TOOL_NAME)]
NATIVE_TOOL_SCHEMAS = [_function_tool(name) for name in TOOL_NAMES]


def tool_interface_of(names: Iterable[str]) -> str | None:
    """The ``--tool-interface`` whose tools are exactly ``names`` (``browser`` or ``native``), else None.

    Rows record the interface they were prepared for as the tools in ``responses_create_params.tools``; the
    submit script's ``TOOL_INTERFACE`` picks the tool config with the same names.
    """
    named = set(names)
    if named == {SINGLE_TOOL_NAME}:
        return "browser"
    if named == set(TOOL_NAMES):
        return "native"
    return None


def build_row(task: Task, tool_interface: str) -> dict[str, Any]:
    """The NeMo Gym row for a task; a row that came in as one keeps everything it had."""
    if task.row is not None:
        row = dict(task.row)
        if task.verifier_metadata is None:
            row.pop("verifier_metadata", None)
        else:
            row["verifier_metadata"] = task.verifier_metadata
        row.setdefault("task_id", task.task_id)
        for name in REFERENCE_FIELDS:
            if row.get(name) is None and getattr(task, name) is not None:
                row[name] = getattr(task, name)
        return row
    system = SYSTEM_PROMPT_BROWSER if tool_interface == "browser" else SYSTEM_PROMPT_NATIVE
    tools = BROWSER_TOOL_SCHEMAS if tool_interface == "browser" else NATIVE_TOOL_SCHEMAS
    user = USER_PROMPT.format(question=task.question, site=task.site, url=task.initial_url)
    row: dict[str, Any] = {
        "responses_create_params": {
            "input": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "tools": tools,
        },
        "initial_url": task.initial_url,
    }
    if task.verifier_metadata is not None:
        row["verifier_metadata"] = task.verifier_metadata
    row.update(
        task_id=task.task_id,
        site=task.site,
        question=task.question,
        reference_answer=task.reference_answer,
        reference_type=task.reference_type,
        data_source=DATA_SOURCE,
        task_metadata=task.metadata,
    )
    return row
