"""How well a tiny policy does: its success on task samples through the recipe's real loop, against the in-process
environment server.

:func:`evaluate` serves the policy folder with an in-process ``hfcpu`` rollout server (:class:`PolicyServer`) and
plays every sample through ``BrowserToolAgentLoop`` against the in-process environment server, per split and
temperature, in either sample mode (step-wise: the policy sees that mode's bounded prompts); it also counts the
turns that are one well-formed ``browser`` call (:func:`is_tool_call`). The environment server and the loop's
shared HTTP clients are closed when it ends, however it ends.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..gym_contract.browser_calls import ACTIONS, SINGLE_TOOL_NAME
from . import shop_tasks
from .policy_model import PROMPT_LENGTH, RESPONSE_LENGTH

logger = logging.getLogger(__name__)

# A demonstration's turns run to ~30 tokens each; a generated turn longer than this is not a tool call any more.
MAX_TURN_TOKENS = 96


class PolicyServer:
    """verl's server-manager call (``generate(request_id, *, prompt_ids, sampling_params)``) over an in-process
    ``hfcpu`` rollout server (:mod:`.cpu_backend.server`), counting the turns that are one well-formed tool call."""

    def __init__(self, model_dir: Path, *, seed: int = 0) -> None:
        from verl.workers.config import RolloutConfig

        from .cpu_backend import ROLLOUT_NAME
        from .cpu_backend.server import HFCpuServer

        rollout = RolloutConfig(
            name=ROLLOUT_NAME,
            prompt_length=PROMPT_LENGTH,
            response_length=RESPONSE_LENGTH,
            tensor_model_parallel_size=1,
            dtype="float32",
            load_format="auto",
            seed=seed,
        )
        threads = torch.get_num_threads()  # the server sets the process's thread count; keep the caller's
        self.server = HFCpuServer(rollout, {"path": str(model_dir), "override_config": {"attn_implementation": "sdpa"}})
        torch.set_num_threads(threads)
        self.tokenizer = self.server.model_config.tokenizer
        self.turns = 0
        self.tool_calls = 0
        self.generated_tokens = 0

    async def generate(
        self, request_id: str, *, prompt_ids: Sequence[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> Any:
        output = await self.server.generate(prompt_ids, sampling_params, request_id)
        self.turns += 1
        self.generated_tokens += len(output.token_ids)
        self.tool_calls += is_tool_call(self.tokenizer.decode(output.token_ids, skip_special_tokens=True))
        return output


def is_tool_call(text: str) -> bool:
    """Whether a generated turn is exactly one hermes call of the ``browser`` tool with a known action."""
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL)
    if len(blocks) != 1 or text.replace(blocks[0], "").strip() != "<tool_call></tool_call>":
        return False
    try:
        call = json.loads(blocks[0])
    except json.JSONDecodeError:
        return False
    arguments = call.get("arguments") if isinstance(call, dict) else None
    return call.get("name") == SINGLE_TOOL_NAME and isinstance(arguments, dict) and arguments.get("action") in ACTIONS


@dataclass
class EvaluationResult:
    split: str
    temperature: float
    episodes: int
    success: float
    success_by_kind: dict[str, float]
    tool_call_rate: float
    browsed: float  # the share of episodes that acted on the page before answering
    tokens_per_episode: float
    generated_tokens_per_episode: float
    seconds: float
    episodes_played: list[tuple[str, float, int]] = field(default_factory=list)  # (task id, reward, browser calls)
    sample_mode: str = "trajectory"


async def evaluate(
    model_dir: Path,
    samples: dict[str, Sequence[dict[str, Any]]],
    *,
    temperatures: Sequence[float] = (1.0, 0.0),
    episodes_per_task: int = 1,
    seed: int = 0,
    max_turn_tokens: int = MAX_TURN_TOKENS,
    max_assistant_turns: int = 8,
    sample_mode: str = "trajectory",
) -> list[EvaluationResult]:
    """Success of the policy in ``model_dir`` on each split's samples, through the real loop, against the in-process
    environment server.

    Sampled episodes (``temperature > 0``) run ``episodes_per_task`` times per task; greedy ones once. In
    ``stepwise`` mode an episode's tokens are those of all its step samples.
    """
    from ..browser_agent_loop import close_shared_clients
    from .environment_server.server import InProcessEnvironmentServer
    from .in_process_loop import SAMPLE_MODES, build_loop, compose_trainer_config, load_tools, run_episode

    if sample_mode not in SAMPLE_MODES:
        raise ValueError(f"sample mode must be one of {SAMPLE_MODES}, not {sample_mode!r}")
    stepwise = sample_mode == "stepwise"
    records = shop_tasks.records_by_id()
    config = compose_trainer_config(
        prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH,
        overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max_assistant_turns}"],
    )
    tools = load_tools()
    policy = PolicyServer(model_dir, seed=seed)
    results = []
    try:
        async with InProcessEnvironmentServer(site=shop_tasks.in_process_site()) as server:
            for temperature in temperatures:
                sampling = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_tokens": max_turn_tokens}
                for split, split_samples in samples.items():
                    started, turns, calls, generated = time.monotonic(), policy.turns, policy.tool_calls, 0
                    rewards: dict[str, list[float]] = {}
                    tokens, browsed, played = [], [], []
                    for sample in split_samples:
                        for _ in range(episodes_per_task if temperature > 0 else 1):
                            before = policy.generated_tokens
                            loop = build_loop(
                                policy,
                                tokenizer=policy.tokenizer,
                                tools=tools,
                                trainer_config=config,
                                environment={"server_urls": [server.url]},
                                stepwise={"enabled": stepwise},
                            )
                            outputs = await run_episode(loop, sampling, sample, sample_mode)
                            output = outputs[-1]  # every step sample carries the episode's reward and flags
                            kind = records[sample["extra_info"]["task_id"]]["kind"]
                            rewards.setdefault(kind, []).append(output.reward_score or 0.0)
                            tokens.append(sum(len(o.prompt_ids) + len(o.response_ids) for o in outputs))
                            actions = int(output.extra_fields.get("env_browser_actions", 0))
                            browsed.append(actions > 0)
                            played.append((sample["extra_info"]["task_id"], output.reward_score or 0.0, actions))
                            generated += policy.generated_tokens - before
                    every = [reward for kind_rewards in rewards.values() for reward in kind_rewards]
                    results.append(
                        EvaluationResult(
                            split=split,
                            temperature=temperature,
                            episodes=len(every),
                            success=sum(every) / len(every),
                            success_by_kind={kind: sum(r) / len(r) for kind, r in sorted(rewards.items())},
                            tool_call_rate=(policy.tool_calls - calls) / max(policy.turns - turns, 1),
                            browsed=sum(browsed) / len(browsed),
                            tokens_per_episode=sum(tokens) / len(tokens),
                            generated_tokens_per_episode=generated / len(every),
                            seconds=time.monotonic() - started,
                            episodes_played=played,
                            sample_mode=sample_mode,
                        )
                    )
                    logger.info("evaluated %s", results[-1])
    finally:
        await close_shared_clients()
    return results
