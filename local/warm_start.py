"""The supervised warm start: demonstrations the recipe's own loop recorded, and next-token training on them.

:func:`collect_demonstrations` has the real ``BrowserToolAgentLoop`` play the scripted shop player
(:mod:`.shop_scripts`) on task samples prepared by ``prepare_webvoyager_data.py`` like any user's task list
(:func:`load_samples`), against the in-process environment server; what is kept is exactly what the loop produced:
``prompt_ids``, ``response_ids`` and ``response_mask``. :func:`warm_start` trains on the tokens the loop marked as the
model's (``response_mask == 1``), never on the prompt or on tool responses. The demonstrations always act in the
right format and order, on copies of the shop whose links are listed in a shuffled order, and pick the element the
task names with probability ``correct`` (:class:`WarmStartSpec`), so which element to pick is left for RL to learn.
They are played in either sample mode (``settings.SAMPLE_MODES``): a step-wise episode gives one
demonstration per step, each over the bounded prompt that mode shows the policy.

Deterministic for a seed and a thread count: the same seed gives the same demonstrations and the same trained
weights. The environment server and the loop's shared HTTP clients are closed when collecting ends, however it ends.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedTokenizerFast, Qwen2ForCausalLM

from . import scripted_policy as sp
from . import shop_tasks
from .policy_model import PROMPT_LENGTH, RESPONSE_LENGTH
from .shop_scripts import Chooser, aisle_script, deal_script, script_for

logger = logging.getLogger(__name__)

# A step-wise loop needs a turn limit; the longest shop task takes 4 turns.
STEPWISE_TURN_LIMIT = 8
# How often a long warm start reports its progress (the mean loss since the last report).
PROGRESS_EVERY = 100
_SCRIPTS = {"deal": deal_script, "aisle": aisle_script}


@dataclass(frozen=True)
class WarmStartSpec:
    """The supervised warm start: demonstrations per training task, how often they pick the named element, and
    the optimiser (AdamW, linear warm-up then cosine decay to a tenth)."""

    correct: float = 0.4
    guess: float = 0.5  # deal tasks: the share of demonstrations that answer at once, without the browser
    demos_per_task: int = 2
    steps: int = 300
    batch_size: int = 8
    lr: float = 1e-2
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0


@dataclass
class Demonstration:
    task_id: str
    kind: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    reward: float | None
    sample_mode: str = "trajectory"  # a step-wise episode gives one demonstration per step

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# ----- demonstrations -------------------------------------------------------------------------------------------


def load_samples(task_file: Path, workdir: Path) -> list[dict[str, Any]]:
    """The verl samples of a task file, as ``BrowserJSONLDataset`` gives them to the agent loop."""
    from ..dataset import BrowserJSONLDataset
    from ..prepare_webvoyager_data import prepare_rows

    dataset = BrowserJSONLDataset(str(prepare_rows(task_file, workdir / task_file.stem)))
    return [dataset[i] for i in range(len(dataset))]


async def collect_demonstrations(
    tokenizer: PreTrainedTokenizerFast,
    samples: Sequence[dict[str, Any]],
    *,
    correct: float,
    per_task: int,
    seed: int,
    guess: float = 0.0,
    shuffle: bool = True,
    sample_modes: Sequence[str] = ("trajectory",),
) -> list[Demonstration]:
    """``per_task`` scripted episodes of each sample, in each of ``sample_modes``, through the real loop against an
    in-process environment server.

    With ``shuffle`` each round of episodes runs on a copy of the shop whose links are listed in another seeded
    order, so the element the task names is at a different position from round to round. A ``deal`` or ``aisle``
    task answers at once from memory with probability ``guess`` (:func:`.shop_scripts.deal_script`,
    :func:`.shop_scripts.aisle_script`); each mode draws its own episodes.
    """
    from ..browser_agent_loop import close_shared_clients
    from .environment_server.server import InProcessEnvironmentServer
    from .in_process_loop import SAMPLE_MODES, build_loop, compose_trainer_config, load_tools, run_episode

    unknown = set(sample_modes) - set(SAMPLE_MODES)
    if unknown or not sample_modes:
        raise ValueError(f"sample modes must be some of {SAMPLE_MODES}, got {list(sample_modes)}")
    records = shop_tasks.records_by_id()
    config = compose_trainer_config(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    stepwise_config = compose_trainer_config(
        prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH,
        overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={STEPWISE_TURN_LIMIT}"],
    )
    tools = load_tools()
    demonstrations = []
    try:
        for repeat in range(per_task):
            # Each round plays every task on its own shuffled copy of the shop.
            site = shop_tasks.in_process_site(order_seed=f"{seed}:{repeat}" if shuffle else None)
            async with InProcessEnvironmentServer(site=site) as server:
                for mode in sample_modes:
                    stepwise = mode == "stepwise"
                    for sample in samples:
                        task_id = sample["extra_info"]["task_id"]
                        record = records[task_id]
                        # the trajectory mode's draws are those of builds that had no other mode
                        key = f"{seed}:{task_id}:{repeat}" + (":stepwise" if stepwise else "")
                        chooser = Chooser(correct, random.Random(key))
                        if record["kind"] in _SCRIPTS:
                            script = _SCRIPTS[record["kind"]](record, chooser, guess)
                        else:
                            script = script_for(record, chooser)
                        loop = build_loop(
                            sp.ScriptedPolicy(tokenizer, script),
                            tokenizer=tokenizer,
                            tools=tools,
                            trainer_config=stepwise_config if stepwise else config,
                            environment={"server_urls": [server.url]},
                            stepwise={"enabled": stepwise},
                        )
                        outputs = await run_episode(loop, {}, sample, mode)
                        demonstrations += episode_demonstrations(outputs, task_id, record["kind"], mode)
    finally:
        await close_shared_clients()
    return demonstrations


def episode_demonstrations(outputs: Any, task_id: str, kind: str, mode: str) -> list[Demonstration]:
    """One episode's samples (one, or one per step in step-wise mode) as demonstrations."""
    demonstrations = []
    for output in outputs:
        if output.extra_fields.get("env_invalid"):
            failure = output.extra_fields.get("env_failure_reason")
            raise RuntimeError(f"the environment server failed a demonstration of {task_id}: {failure}")
        demonstrations.append(
            Demonstration(
                task_id=task_id,
                kind=kind,
                prompt_ids=list(output.prompt_ids),
                response_ids=list(output.response_ids),
                response_mask=list(output.response_mask),
                reward=output.reward_score,
                sample_mode=mode,
            )
        )
    return demonstrations


# ----- the warm start -------------------------------------------------------------------------------------------


def common_prefix_length(demos: Sequence[Demonstration]) -> int:
    """How many leading tokens every demonstration shares (the system prompt and the tools, at least)."""
    sequences = [demo.prompt_ids for demo in demos]
    shortest = min(len(ids) for ids in sequences)
    length = 0
    while length < shortest and all(ids[length] == sequences[0][length] for ids in sequences):
        length += 1
    return length


def _batch(demos: Sequence[Demonstration], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 except on the model's own tokens)."""
    width = max(demo.length for demo in demos)
    input_ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(demos), width), dtype=torch.long)
    labels = torch.full((len(demos), width), -100, dtype=torch.long)
    for row, demo in enumerate(demos):
        ids = torch.tensor(demo.prompt_ids + demo.response_ids)
        mask = torch.tensor([0] * len(demo.prompt_ids) + demo.response_mask, dtype=torch.bool)
        input_ids[row, : len(ids)] = ids
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(mask, ids, -100)
    return input_ids, attention, labels


def demonstration_loss(
    model: Qwen2ForCausalLM, demos: Sequence[Demonstration], pad_id: int, prefix: int
) -> torch.Tensor:
    """Mean next-token loss on the model's own tokens of ``demos``, the same as a plain forward pass would give.

    The first ``prefix`` tokens (shared by every demonstration, see :func:`common_prefix_length`) run once and
    their keys and values are shared by the batch, and the output layer runs only where there is a label: the
    two costs that dominate a batch of long prompts with short answers.
    """
    input_ids, attention, labels = _batch(demos, pad_id)
    batch, width = input_ids.shape
    prefix = min(prefix, width - 1)
    cache = None
    if prefix > 0:
        shared = model.model(input_ids=input_ids[:1, :prefix], use_cache=True).past_key_values
        layers = [
            (layer.keys.expand(batch, -1, -1, -1), layer.values.expand(batch, -1, -1, -1)) for layer in shared.layers
        ]
        cache = DynamicCache(ddp_cache_data=layers, config=model.config)
    positions = torch.arange(prefix, width).expand(batch, -1)
    hidden = model.model(
        input_ids=input_ids[:, prefix:],
        attention_mask=attention,
        position_ids=positions,
        past_key_values=cache,
        use_cache=cache is not None,
    ).last_hidden_state
    # position t predicts token t + 1; no label falls inside the shared prefix (it is prompt)
    targets = labels[:, prefix + 1 :]
    labelled = targets != -100
    logits = model.lm_head(hidden[:, :-1][labelled])
    return torch.nn.functional.cross_entropy(logits.float(), targets[labelled])


def _lr_factor(step: int, spec: WarmStartSpec) -> float:
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(spec.steps - spec.warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def warm_start(
    model: Qwen2ForCausalLM, demos: Sequence[Demonstration], spec: WarmStartSpec, pad_id: int
) -> list[float]:
    """Train ``model`` in place on the demonstrations; returns the loss of every step.

    Each step takes ``batch_size`` demonstrations from a seeded shuffle (a new one per pass over the data).
    """
    if not demos:
        raise ValueError("no demonstrations to learn from")
    rng = random.Random(spec.seed)
    prefix = common_prefix_length(demos)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, spec))
    order: list[int] = []
    losses = []
    model.train()
    for _ in range(spec.steps):
        if len(order) < spec.batch_size:
            fresh = list(range(len(demos)))
            rng.shuffle(fresh)
            order += fresh
        chosen, order = order[: spec.batch_size], order[spec.batch_size :]
        loss = demonstration_loss(model, [demos[i] for i in chosen], pad_id, prefix)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if len(losses) % PROGRESS_EVERY == 0:
            recent = losses[-PROGRESS_EVERY:]
            logger.info("warm start: step %d of %d, mean loss %.4f", len(losses), spec.steps, sum(recent) / len(recent))
    model.eval()
    return losses
