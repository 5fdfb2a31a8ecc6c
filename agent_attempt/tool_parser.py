"""Reading the model's tool calls: verl's hermes parser, except that a malformed call is shown to the model.

What this module owns
    :class:`LenientHermesToolParser`, which the agent loop uses in place of verl's ``hermes`` parser
    whenever the tool format is ``hermes``. Stateless; one instance per loop object.
"""

from __future__ import annotations

import json
import re
from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, HermesToolParser
from verl.utils.ray_utils import get_event_loop


class LenientHermesToolParser(HermesToolParser):
    """verl's hermes parser, except that a malformed ``<tool_call>`` block is not silently dropped.

    Upstream drops a block whose JSON does not parse, so the episode simply ends and the model never learns why.
    Here such a block becomes a call whose arguments are the raw text: verl's own ``_call_tool`` then answers
    "Invalid JSON in arguments ..." (or "Unknown function ...") as a tool message, a policy error the model reads.
    Well-formed blocks parse exactly as upstream, except that arguments written as a JSON string are passed on
    verbatim (so a double-encoded object still reaches the tool as an object).
    """

    _name_in_text = re.compile(r'"name"\s*:\s*"([^"]*)"')

    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list[FunctionCall]]:
        loop = get_event_loop()
        text = await loop.run_in_executor(None, self.tokenizer.decode, responses_ids)
        if self.tool_call_start_token not in text or self.tool_call_end_token not in text:
            return text, []
        calls = []
        for block in self.tool_call_regex.findall(text):
            calls.append(self._call_from_block(block))
        return self.tool_call_regex.sub("", text), calls

    def _call_from_block(self, block: str) -> FunctionCall:
        try:
            payload = json.loads(block)
        except json.JSONDecodeError:
            payload = None
        if isinstance(payload, dict) and isinstance(payload.get("name"), str):
            arguments = payload.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            return FunctionCall(name=payload["name"], arguments=arguments)
        guessed = self._name_in_text.search(block)
        return FunctionCall(name=guessed.group(1) if guessed else "", arguments=block.strip())
