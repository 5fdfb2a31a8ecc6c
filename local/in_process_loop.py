"""Build the recipe's real ``BrowserToolAgentLoop`` in-process, as verl 0.9.1's ``AgentLoopWorker`` does, minus Ray.

What it gives tests and benchmarks
    * :func:`compose_trainer_config`: verl's own ``ppo_trainer`` config composed by hydra from the installed verl,
      with the recipe's overrides (every override key is checked by hydra, as on the ``main_ppo`` command line).
    * :func:`load_tools`: the recipe's tool configs loaded by verl's ``initialize_tools_from_config``.
    * :func:`build_loop`: the agent loop instantiated from ``configs/agent_loop.yaml`` by ``hydra.utils.instantiate``
      with exactly the keyword arguments ``AgentLoopWorker._run_agent_loop`` passes (one loop per sample, as verl).
    * :func:`run_episode`: one episode of a loop in either sample mode (:data:`SAMPLE_MODES`), as its samples.
    * :func:`make_row`: one dataset sample in the shape ``dataset.py`` produces.
    * :func:`save_tokenizer_and_config`: a model folder (tokenizer + tiny config) for verl's ``HFModelConfig``, so a
      real ``AgentLoopWorker`` can be built too.

Nothing here talks to the network except the environment server URLs the caller passes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import verl
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.tools.tool_registry import initialize_tools_from_config
from verl.utils.dataset.rl_dataset import RLHFDataset

from ..agent_attempt.browser_tool import AGENT_LOOP_NAME
from ..dataset import DEFAULT_DATA_SOURCE, EPISODE_TOOLS
from ..settings import SAMPLE_MODES
from .chat_tokenizer import save_tokenizer_and_config

__all__ = [
    "AGENT_LOOP_YAML",
    "CONFIG_DIR",
    "NATIVE_TOOLS_YAML",
    "SAMPLE_MODES",
    "SINGLE_TOOL_YAML",
    "agent_loop_entry",
    "build_loop",
    "compose_trainer_config",
    "load_tools",
    "make_row",
    "run_episode",
    "save_tokenizer_and_config",
]

RECIPE_DIR = Path(__file__).resolve().parent.parent
CONFIG_DIR = RECIPE_DIR / "configs"
AGENT_LOOP_YAML = CONFIG_DIR / "agent_loop.yaml"
SINGLE_TOOL_YAML = CONFIG_DIR / "browser_tool.yaml"
NATIVE_TOOLS_YAML = CONFIG_DIR / "browser_native_tools.yaml"
VERL_CONFIG_DIR = Path(verl.__file__).resolve().parent / "trainer" / "config"
# The model family verl's Continuous-Token builder keys on: the chat tokenizer speaks Qwen's ChatML.
HF_MODEL_TYPE = "qwen2"

SYSTEM_PROMPT = "You are a web agent. Use the browser to solve the task, then finish with your answer."


def compose_trainer_config(
    *,
    response_length: int = 16384,
    prompt_length: int = 4096,
    native_tools: bool = False,
    overrides: Sequence[str] = (),
) -> DictConfig:
    """verl's composed ``ppo_trainer`` config with the recipe's multi-turn settings (plus ``overrides``)."""
    tool_config = NATIVE_TOOLS_YAML if native_tools else SINGLE_TOOL_YAML
    recipe = [
        "actor_rollout_ref.rollout.name=vllm",  # only read, never started: the server manager is the caller's
        f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOP_YAML}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=nemo_gym_browser_agent",
    ]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
            return compose(config_name="ppo_trainer", overrides=[*recipe, *overrides])
    finally:
        GlobalHydra.instance().clear()


def load_tools(*, native: bool = False, path: str | os.PathLike[str] | None = None) -> list[Any]:
    """The recipe's tools, loaded by verl's own ``initialize_tools_from_config`` (its schema print is silenced)."""
    config_path = Path(path) if path is not None else (NATIVE_TOOLS_YAML if native else SINGLE_TOOL_YAML)
    with contextlib.redirect_stdout(io.StringIO()):
        return initialize_tools_from_config(str(config_path))


def agent_loop_entry(**settings: Any) -> DictConfig:
    """The agent loop's entry (``AGENT_LOOP_NAME``) of ``configs/agent_loop.yaml`` with ``settings`` merged over it.

    Nested mappings merge key by key (``environment={"server_urls": [...]}`` keeps the other environment keys).
    """
    entries = OmegaConf.load(AGENT_LOOP_YAML)
    entry = next(e for e in entries if e.name == AGENT_LOOP_NAME)
    return OmegaConf.merge(entry, OmegaConf.create(dict(settings)))


def build_loop(
    server_manager: Any,
    *,
    tokenizer: Any,
    tools: Sequence[Any],
    trainer_config: DictConfig | None = None,
    **settings: Any,
) -> Any:
    """One ``BrowserToolAgentLoop``, instantiated the way ``AgentLoopWorker._run_agent_loop`` instantiates it."""
    config = trainer_config if trainer_config is not None else compose_trainer_config()
    return hydra.utils.instantiate(
        config=agent_loop_entry(**settings),
        trainer_config=DictConfigWrap(config=config),
        server_manager=server_manager,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type=HF_MODEL_TYPE,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(list(tools)),
    )


async def run_episode(loop: Any, sampling: Mapping[str, Any], sample: Mapping[str, Any], sample_mode: str) -> list[Any]:
    """One episode of a loop :func:`build_loop` made with ``stepwise.enabled`` matching ``sample_mode``: its one
    sample, or its step samples (run with the keyword arguments verl's V1 worker passes, without which the loop
    refuses step-wise mode). Each carries the episode's reward and flags."""
    if sample_mode not in SAMPLE_MODES:
        raise ValueError(f"sample mode must be one of {SAMPLE_MODES}, not {sample_mode!r}")
    v1 = {"uid": f"episode-{sample.get('index', 0)}", "session_id": 0, "global_steps": 0}
    outputs = await loop.run(dict(sampling), **sample, **(v1 if sample_mode == "stepwise" else {}))
    return outputs if isinstance(outputs, list) else [outputs]


def make_row(
    *,
    task: str,
    task_id: str = "task-1",
    initial_url: str | None = "site/index.html",
    verifier_metadata: Mapping[str, Any] | None = None,
    reference_answer: str | None = None,
    index: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
) -> dict[str, Any]:
    """One sample as ``dataset.py`` makes it (the keys ``BrowserToolAgentLoop.run`` reads, and verl's own)."""
    episode = {
        "task_id": task_id,
        "initial_url": initial_url,
        "verifier_metadata": dict(verifier_metadata) if verifier_metadata else None,
        "task": {"question": task, "site": None, "reference_answer": reference_answer, "reference_type": None},
    }
    return {
        "raw_prompt": [{"role": "system", "content": system_prompt}, {"role": "user", "content": task}],
        "tools_kwargs": {tool: {"create_kwargs": copy.deepcopy(episode)} for tool in EPISODE_TOOLS},
        "agent_name": AGENT_LOOP_NAME,
        "index": index,
        "data_source": DEFAULT_DATA_SOURCE,
        "extra_info": {"index": index, "task_id": task_id},
    }


# Re-exported so a caller needs one import for a model folder too.
save_tokenizer_and_config = save_tokenizer_and_config
