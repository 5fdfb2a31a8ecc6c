"""A random tiny model, a data set and a reward for exercising ``main_ppo`` and the ``hfcpu`` rollout on CPU.

What it gives
    * :func:`save_random_policy`: a model folder ``from_pretrained`` loads: the in-process chat tokenizer
      (``local/chat_tokenizer.py``) and a randomly initialised two-layer Qwen2 with real weights, seeded, so two calls
      with the same seed write the same model and different seeds different ones.
    * :func:`write_toy_dataset`: verl's RL parquet rows (``prompt`` as chat messages, ``reward_model.ground_truth``).
    * :func:`compute_score`: a reward for ``reward.custom_reward_function`` whose values differ within a group
      (so GRPO has a signal): 1 when the answer contains the ground truth, plus a small length term.

Nothing is downloaded. The model learns nothing useful; it exists so that every stage of a training step runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..chat_tokenizer import save_tokenizer_and_config

__all__ = ["compute_score", "save_random_policy", "write_toy_dataset"]

DATA_SOURCE = "cpu_backend_toy"


def save_random_policy(directory: str | Path, *, seed: int = 0, hidden_size: int = 32, init_std: float = 0.5) -> Path:
    """Write tokenizer, config, generation config and seeded random weights of a tiny Qwen2 into ``directory``.

    ``init_std`` is far above a real model's 0.02 so that the untrained model's next-token distributions are peaked
    and varied (greedy decoding does not repeat one token, sampling does not look uniform).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = save_tokenizer_and_config(directory, hidden_size=hidden_size)
    config = AutoConfig.from_pretrained(directory)
    config.initializer_range = init_std
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(directory)
    return directory


def write_toy_dataset(directory: str | Path, *, rows: int = 4) -> dict[str, Path]:
    """Write ``train.parquet`` (``rows`` prompts) and ``val.parquet`` (half of them) into ``directory``."""
    import pandas as pd

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    records = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"Say the number {i}."}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(rows)
    ]
    paths = {"train": directory / "train.parquet", "val": directory / "val.parquet"}
    pd.DataFrame(records).to_parquet(paths["train"])
    pd.DataFrame(records[: max(1, rows // 2)]).to_parquet(paths["val"])
    return paths


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **kwargs: Any
) -> float:
    """1 for containing the ground truth, plus 0.01 per character up to 50 (so group members differ)."""
    answer = solution_str or ""
    return float(ground_truth in answer) + 0.01 * min(len(answer), 50)
