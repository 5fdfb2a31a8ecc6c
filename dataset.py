"""NeMo Gym rows -> the samples verl's agent loop workers and trainers consume.

Use it through verl's custom-dataset hook (the package is installed, so the ``pkg://`` form resolves; a file path
would load this module outside its package)::

    data.custom_cls.path=pkg://nemo_gym_browser.dataset
    data.custom_cls.name=BrowserJSONLDataset

What it reads
    JSONL files of NeMo Gym rows, every non-blank line: ``responses_create_params.input`` (the prompt),
    ``initial_url``, optional ``verifier_metadata`` and ``agent_ref``, and the task fields that
    ``prepare_webvoyager_data.py`` adds (``task_id``, ``site``, ``question``, ``reference_answer``,
    ``reference_type``, ``data_source``, ``task_metadata``). The validation is the one the preparation script
    applies, ``verifier_metadata`` under the one rule of :func:`rows.validate_verifier_metadata`, so a row that
    the server would answer 500 or grade on another key than it names at verify time is refused at load time with
    its ``file:line`` (:class:`RowError`).

What each sample holds (the contract with ``episode.EpisodeSpec``; every key is present in every sample, so
verl's ``collate_fn`` makes one column per key)
    ``raw_prompt``       chat messages ``[{"role", "content"}]`` (``developer`` becomes ``system``)
    ``tools_kwargs``     ``{tool: {"create_kwargs": EPISODE}}`` for ``browser`` and for each of NeMo Gym's five
                         ``browser_*`` tools, so either tool config finds its entry. The loop opens the episode's
                         session from ``tools_kwargs["browser"]["create_kwargs"]``, present whatever the tools.
    ``agent_name``       ``nemo_gym_browser_agent``
    ``index``            position of the row in the dataset (int); ``extra_info["index"]`` too
    ``data_source``      the row's ``data_source``, else ``nemo_gym``
    ``extra_info``       the task for reward functions, the judge and logs: ``EPISODE``'s fields flat, plus
                         ``index``, ``task_metadata`` and ``source`` (``file:line``)
    ``reward_model``     ``{"style": "rule" | "model", "ground_truth": reference answer or None}`` (``rule`` when
                         ``verifier_metadata`` grades the task); verl's validation dumps read ``ground_truth``
    ``agent_ref``        the row's ``agent_ref`` or None; ``extra_env_info``: every other row key, and
                         ``_rcp_extra`` for the other ``responses_create_params`` keys (verl-recipe's
                         ``NeMoGymJSONLDataset`` fields, kept so a row reads the same through either class)
    ``dummy_tensor``     ``tensor([0], dtype=uint8)``: verl's batch needs one tensor column

    ``EPISODE = {"task_id": str, "initial_url": str | None, "verifier_metadata": dict | None,
    "task": {"question": str, "site": str | None, "reference_answer": str | None, "reference_type": str | None}}``

Guarantees
    A sample is a fresh copy: mutating it (verl appends to the messages) never changes the dataset. Loading
    fails on the first malformed row, naming its file and line (malformed or non-finite JSON, a duplicate key,
    deep nesting, a start URL that is not http(s) or a path inside the server's folder), and on a dataset without
    rows.
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

from .browser_calls import SINGLE_TOOL_NAME, TOOL_NAMES
from .browser_tool import AGENT_LOOP_NAME
from .rows import RowValueError, parse_row_json
from .tasks import InputError, Task, task_from_nemo_gym_row

logger = logging.getLogger(__name__)

DEFAULT_DATA_SOURCE = "nemo_gym"
EPISODE_TOOLS = (SINGLE_TOOL_NAME, *TOOL_NAMES)
# responses_create_params keys the prompt already carries, or that sampling settings of the trainer replace.
_RCP_CONSUMED = frozenset({"input", "temperature", "top_p", "top_k", "parallel_tool_calls"})
# Row keys that become sample columns of their own rather than extra_env_info.
_ROW_COLUMNS = frozenset({"responses_create_params", "agent_ref"})


class RowError(ValueError):
    """A row this dataset cannot turn into a sample; the message starts with ``file:line``."""


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
    """Every non-blank line of one JSONL file as a validated task; the first bad line raises RowError."""
    tasks = []
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise RowError(f"{path}: cannot read: {exc.strerror}") from exc
    with handle:
        for lineno, raw in enumerate(handle, 1):
            location = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError as exc:
                raise RowError(f"{location}: not valid UTF-8 ({exc.reason})") from exc
            if not text.strip():
                continue
            try:
                obj = parse_row_json(text)
            except RowValueError as exc:
                raise RowError(f"{location}: {exc}") from None
            if not isinstance(obj, Mapping) or "responses_create_params" not in obj:
                raise RowError(
                    f"{location}: not a NeMo Gym row (no 'responses_create_params'); see prepare_webvoyager_data.py"
                )
            try:
                tasks.append(task_from_nemo_gym_row(obj, location))
            except InputError as exc:
                raise RowError(str(exc)) from exc
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
            raise RowError("no data files given")
        self.data_files = [str(path) for path in files]
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config

        tasks = [task for path in self.data_files for task in read_rows(Path(path))]
        if not tasks:
            raise RowError(f"no rows in {', '.join(self.data_files)}")
        seen: dict[str, str] = {}
        for task in tasks:
            if task.task_id in seen:
                raise RowError(f"{task.location}: duplicate task id {task.task_id!r} (first at {seen[task.task_id]})")
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
