"""NeMo Gym rows -> the samples verl's agent loop workers and trainers consume (:class:`BrowserJSONLDataset`).

Use it through verl's custom-dataset hook (the package is installed, so the ``pkg://`` form resolves; a file path
would load this module outside its package)::

    data.custom_cls.path=pkg://nemo_gym_browser.dataset
    data.custom_cls.name=BrowserJSONLDataset

Contract: every sample holds the same keys (``raw_prompt``, ``tools_kwargs`` with the episode for ``browser`` and
each native tool, ``agent_name``, ``index``, ``data_source``, ``extra_info``, ``reward_model``, ``agent_ref``,
``extra_env_info``, ``dummy_tensor``), the contract with ``episode.EpisodeSpec``; each is a fresh copy, so verl
mutating it never changes the dataset. The keys in full: ``docs/data.md``.

Errors: loading fails on the first malformed row, an :class:`~nemo_gym_browser.task_lists.tasks.InputError` naming its
``file:line`` (the rules of :mod:`~nemo_gym_browser.gym_contract.rows`, as in data preparation), and on a dataset
without rows.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .agent_attempt.browser_tool import AGENT_LOOP_NAME
from .gym_contract.browser_calls import SINGLE_TOOL_NAME, TOOL_NAMES
from .gym_contract.rows import RowValueError, parse_row_json
from .task_lists.tasks import InputError, Task, task_from_nemo_gym_row

logger = logging.getLogger(__name__)

DEFAULT_DATA_SOURCE = "nemo_gym"
EPISODE_TOOLS = (SINGLE_TOOL_NAME, *TOOL_NAMES)
# responses_create_params keys the prompt already carries, or that sampling settings of the trainer replace.
_RCP_CONSUMED = frozenset({"input", "temperature", "top_p", "top_k", "parallel_tool_calls"})
# Row keys that become sample columns of their own rather than extra_env_info.
_ROW_COLUMNS = frozenset({"responses_create_params", "agent_ref"})


def _episode(task: Task) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "initial_url": task.initial_url,
        "verifier_metadata": task.verifier_metadata,
        "task": {
            "question": task.question,
            "site": task.site,
            "reference_answer": task.reference_answer,
            "reference_type": task.reference_type,
        },
    }


def _sample(task: Task, index: int) -> dict[str, Any]:
    """Everything of a sample except the tensor, as plain JSON-able data."""
    row = task.row or {}
    rcp = row.get("responses_create_params") or {}
    episode = _episode(task)
    extra_env_info = {key: value for key, value in row.items() if key not in _ROW_COLUMNS}
    extra_env_info["_rcp_extra"] = {key: value for key, value in rcp.items() if key not in _RCP_CONSUMED}
    return {
        "raw_prompt": task.messages,
        "tools_kwargs": {tool: {"create_kwargs": copy.deepcopy(episode)} for tool in EPISODE_TOOLS},
        "agent_name": AGENT_LOOP_NAME,
        "index": index,
        "data_source": row.get("data_source") or DEFAULT_DATA_SOURCE,
        "extra_info": {
            "index": index,
            "task_id": task.task_id,
            "initial_url": task.initial_url,
            "verifier_metadata": task.verifier_metadata,
            **episode["task"],
            "task_metadata": task.metadata,
            "source": task.location,
        },
        "reward_model": {
            "style": "rule" if task.verifier_metadata is not None else "model",
            "ground_truth": task.reference_answer,
        },
        "agent_ref": row.get("agent_ref"),
        "extra_env_info": extra_env_info,
    }


def row_tool_names(sample: Mapping[str, Any]) -> list[str] | None:
    """The tools a sample's row teaches (the names in its ``responses_create_params.tools``), None if it names none.

    That list is how a row records the tool interface it was prepared for; the model is given the tools of the
    trainer's tool config, so the two must agree (``preflight.py`` checks it).
    """
    extra_env_info = sample.get("extra_env_info")
    rcp_extra = extra_env_info.get("_rcp_extra") if isinstance(extra_env_info, Mapping) else None
    tools = rcp_extra.get("tools") if isinstance(rcp_extra, Mapping) else None
    if not isinstance(tools, list) or not tools:
        return None
    names = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        # Responses-API tools carry the name at the top; chat-completions tools under "function".
        function = tool.get("function")
        name = tool.get("name") or (function.get("name") if isinstance(function, Mapping) else None)
        if isinstance(name, str) and name:
            names.append(name)
    return names or None


def read_rows(path: Path) -> list[Task]:
    """Every non-blank line of one JSONL file as a validated task; the first bad line raises InputError."""
    tasks = []
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror}") from exc
    with handle:
        for lineno, raw in enumerate(handle, 1):
            location = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError as exc:
                raise InputError(location, f"not valid UTF-8 ({exc.reason})") from exc
            if not text.strip():
                continue
            try:
                obj = parse_row_json(text)
            except RowValueError as exc:
                raise InputError(location, str(exc)) from None
            if not isinstance(obj, Mapping) or "responses_create_params" not in obj:
                raise InputError(
                    location, "not a NeMo Gym row (no 'responses_create_params'); see prepare_webvoyager_data.py"
                )
            tasks.append(task_from_nemo_gym_row(obj, location))
    return tasks


class BrowserJSONLDataset(Dataset):
    """NeMo Gym JSONL rows as verl samples (see the module docstring for the sample contract).

    Built by verl as ``cls(data_files=..., tokenizer=..., processor=..., config=data_config, max_samples=...)``.
    ``max_samples > 0`` keeps that many rows: the first ones, or a seeded random choice when ``config.shuffle``
    is set (as verl's own RLHFDataset does). The tokenizer is not needed: the agent loop applies the chat template.
    """

    def __init__(
        self,
        data_files: str | Sequence[str],
        tokenizer: Any = None,
        processor: Any = None,
        config: Mapping[str, Any] | None = None,
        max_samples: int = -1,
    ):
        config = config if config is not None else {}
        files = [data_files] if isinstance(data_files, str | Path) else list(data_files)
        if not files:
            raise InputError(None, "no data files given")
        self.data_files = [str(path) for path in files]
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config

        tasks = [task for path in self.data_files for task in read_rows(Path(path))]
        if not tasks:
            raise InputError(None, f"no rows in {', '.join(self.data_files)}")
        seen: dict[str, str] = {}
        for task in tasks:
            if task.task_id in seen:
                raise InputError(task.location, f"duplicate task id {task.task_id!r} (first at {seen[task.task_id]})")
            seen[task.task_id] = task.location
        if 0 < max_samples < len(tasks):
            if config.get("shuffle", False):
                seed = config.get("seed")
                rng = np.random.default_rng(*(() if seed is None else (seed,)))
                chosen = sorted(rng.choice(len(tasks), size=max_samples, replace=False).tolist())
                tasks = [tasks[i] for i in chosen]
            else:
                tasks = tasks[:max_samples]
        self._samples = [_sample(task, index) for index, task in enumerate(tasks)]
        logger.info("BrowserJSONLDataset: %d rows from %s", len(self._samples), ", ".join(self.data_files))

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, item: int) -> dict[str, Any]:
        sample = copy.deepcopy(self._samples[item])
        sample["dummy_tensor"] = torch.tensor([0], dtype=torch.uint8)
        return sample

    @classmethod
    async def process_multi_modal_info(
        cls, messages: list[dict], image_patch_size: int, config: Any
    ) -> tuple[None, None, None]:
        """Browser prompts are text: no images, videos or audio (verl asks only when a processor is configured)."""
        return None, None, None
