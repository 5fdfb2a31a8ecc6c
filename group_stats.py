"""The ``grpo_env_aware`` advantage estimator: GRPO whose baseline ignores infrastructure failures.

Per prompt group: a valid sample gets GRPO over the valid members only,
``advantage = (score - mean_valid) / (std_valid + epsilon)`` (``score - mean_valid`` when
``norm_adv_by_std_in_grpo`` is false); a sample flagged ``env_invalid`` or with a score that is not finite gets 0 on
every token; a group with fewer than two valid samples, a plain group of one included, gets 0 everywhere. With no
flag set every group of two or more gets the same bits as verl's ``compute_grpo_outcome_advantage`` for float32
rewards.

Pure tensor math, vectorised (no Python loop over samples). Importing this module registers the estimator with
verl's ``register_adv_est`` (safe across reloads; a ``ValueError`` from verl when another estimator owns the name).
Details and the reference case: ``docs/estimator-and-wiring.md``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from .trainer_side.wiring import ESTIMATOR_MARK, ESTIMATOR_NAME

logger = logging.getLogger(__name__)

# Same default as verl's compute_grpo_outcome_advantage, so unflagged results match bit for bit.
DEFAULT_EPSILON = 1e-6


def group_ids(index: Any) -> torch.Tensor:
    """Map per-sample group labels (uid strings, ints, a tensor) to int64 ids ``0..G-1`` in order of first appearance.

    Labels that compare equal share an id, as they share a key in stock GRPO's dict.
    """
    import pandas as pd  # a verl dependency; imported lazily to keep this module's import cheap

    if isinstance(index, torch.Tensor):
        labels = index.detach().reshape(-1).cpu().numpy()
    else:
        labels = np.asarray(index)
        if labels.ndim != 1:
            labels = labels.reshape(-1)
    codes, _ = pd.factorize(labels, use_na_sentinel=False)
    return torch.from_numpy(np.asarray(codes, dtype=np.int64))


def invalid_mask(env_invalid: Any, size: int) -> torch.Tensor:
    """Per-sample ``env_invalid`` flags as a bool tensor; ``None`` (whole batch or one sample) means valid."""
    if env_invalid is None:
        return torch.zeros(size, dtype=torch.bool)
    if isinstance(env_invalid, torch.Tensor):
        flags = env_invalid.detach().reshape(-1).cpu().to(torch.bool)
    else:
        array = np.asarray(env_invalid)
        if array.dtype == object:
            array = np.equal(array, True)  # None and missing values count as valid
        flags = torch.from_numpy(np.ascontiguousarray(array.reshape(-1), dtype=np.bool_))
    if flags.numel() != size:
        raise ValueError(f"env_invalid has {flags.numel()} entries for {size} samples")
    return flags


def _unbiased_std(members: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Row-wise ``torch.std`` (correction 1) of ``members`` as stock GRPO's per-group 1-D call computes it."""
    if members.dtype not in (torch.float32, torch.float64):
        return members.std(dim=1, keepdim=True)
    deviations = members.double() - mean.double()
    squares = deviations * deviations
    total = torch.zeros_like(squares[:, :1])
    for column in range(squares.shape[1]):  # sequential, like the CPU kernel: one step per group member
        total = total + squares[:, column : column + 1]
    return torch.sqrt(total / (squares.shape[1] - 1)).to(members.dtype)


def grpo_env_aware_scores(
    scores: torch.Tensor,
    group: torch.Tensor,
    invalid: torch.Tensor,
    *,
    epsilon: float = DEFAULT_EPSILON,
    norm_adv_by_std: bool = True,
) -> torch.Tensor:
    """Per-sample scalar advantages: GRPO over each group's valid members, 0 for invalid samples and small groups."""
    advantages = torch.zeros_like(scores)
    valid_rows = torch.nonzero(~invalid).squeeze(1)
    if valid_rows.numel() == 0:
        return advantages
    valid_group = group[valid_rows]
    rows_by_group = valid_rows[torch.argsort(valid_group, stable=True)]  # keeps sample order inside a group
    counts = torch.bincount(valid_group)
    starts = torch.cumsum(counts, 0) - counts
    for size in torch.unique(counts[counts >= 2]).tolist():
        first = starts[counts == size]
        members = rows_by_group[first.unsqueeze(1) + torch.arange(size)]  # (groups, size) sample indices
        group_scores = scores[members]
        mean = group_scores.mean(dim=1, keepdim=True)
        if norm_adv_by_std:
            advantages[members] = (group_scores - mean) / (_unbiased_std(group_scores, mean) + epsilon)
        else:
            advantages[members] = group_scores - mean
    return advantages


def compute_grpo_env_aware_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = DEFAULT_EPSILON,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    env_invalid: Any = None,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator ``grpo_env_aware``: stock GRPO's arguments plus ``env_invalid`` (one bool per sample).

    ``norm_adv_by_std_in_grpo=None`` reads ``config.norm_adv_by_std_in_grpo`` (default true): verl's generic
    estimator call passes only ``config``. Extra keyword arguments verl hands to every estimator (for example
    ``reward_baselines``) are ignored. Returns ``(advantages, returns)``, the same tensor twice, like stock GRPO.
    """
    if index is None:
        raise ValueError(f"{ESTIMATOR_NAME} needs the group index (the batch's 'uid' column)")
    if norm_adv_by_std_in_grpo is None:
        norm_adv_by_std_in_grpo = bool(config.get("norm_adv_by_std_in_grpo", True)) if config is not None else True
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        group = group_ids(index).to(scores.device)
        if group.numel() != scores.numel():
            raise ValueError(f"index has {group.numel()} entries for {scores.numel()} samples")
        invalid = invalid_mask(env_invalid, scores.numel()).to(scores.device)
        unmeasured = ~torch.isfinite(scores)
        if bool(unmeasured.any()):
            count = int(unmeasured.sum())
            logger.warning("%s: %d sample(s) with a non-finite score left out of their groups", ESTIMATOR_NAME, count)
            invalid = invalid | unmeasured
        scalars = grpo_env_aware_scores(
            scores, group, invalid, epsilon=epsilon, norm_adv_by_std=norm_adv_by_std_in_grpo
        )
        advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


setattr(compute_grpo_env_aware_advantage, ESTIMATOR_MARK, True)


def register() -> None:
    """Register ``grpo_env_aware`` with verl; a no-op when done, and a reload of this module replaces its own entry.

    Raises ``ValueError`` (from verl) when a different estimator already owns the name.
    """
    from verl.trainer.ppo import core_algos

    existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR_NAME)
    if existing is compute_grpo_env_aware_advantage:
        return
    if existing is not None and getattr(existing, ESTIMATOR_MARK, False):
        core_algos.ADV_ESTIMATOR_REGISTRY[ESTIMATOR_NAME] = compute_grpo_env_aware_advantage
        return
    core_algos.register_adv_est(ESTIMATOR_NAME)(compute_grpo_env_aware_advantage)


register()
