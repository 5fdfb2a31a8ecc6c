"""The names the recipe's trainer wiring shares with verl and with itself: one definition each.

The root's ``patches.py`` (installing the wrappers, imported at interpreter start-up) and ``trainer_wrappers.py``
(what the wrappers do) both read these, and so do the estimator and the local training stack. Standard library only:
importing this module imports neither torch nor verl.
"""

from __future__ import annotations

EXTRA_FIELDS_KEY = "extra_fields"  # the single TransferQueue field holding AgentLoopOutput.extra_fields
ESTIMATOR_NAME = "grpo_env_aware"  # the advantage estimator's name in verl's registry
# Set on the estimator function: how the wiring tells its own registry entry (from any reload of the estimator's
# module) from another estimator registered under the same name.
ESTIMATOR_MARK = "_nemo_gym_browser_estimator"
INVALID_FRACTION_METRIC = "grpo_env_aware/invalid_fraction"
# A JSONL path: when set, the V1 trainer appends one line per advantage computation with every sample's group, flag,
# score and advantage, so what the estimator did inside a real run can be checked (and read) sample by sample.
ADVANTAGE_LOG_ENV = "NEMO_GYM_BROWSER_ADVANTAGE_LOG"
# "0" (or false, no, off) turns the whole trainer wiring off in every process: the escape hatch a PatchError names.
PATCHES_ENV = "NEMO_GYM_BROWSER_PATCHES"
PADDING_TAG = "is_padding"  # V1: tag of the synthetic samples verl appends to make the batch divisible

# The verl modules the wiring patches, in verl's own import order.
CORE_ALGOS = "verl.trainer.ppo.core_algos"
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
V1_UTILS = "verl.trainer.ppo.v1.utils"
V1_TRAINER_BASE = "verl.trainer.ppo.v1.trainer_base"
TARGETS = (CORE_ALGOS, RAY_TRAINER, V1_UTILS, V1_TRAINER_BASE)


class PatchError(RuntimeError):
    """verl does not have the functions this recipe wraps where and how it expects them."""


__all__ = [
    "ADVANTAGE_LOG_ENV",
    "CORE_ALGOS",
    "ESTIMATOR_MARK",
    "ESTIMATOR_NAME",
    "EXTRA_FIELDS_KEY",
    "INVALID_FRACTION_METRIC",
    "PADDING_TAG",
    "PATCHES_ENV",
    "RAY_TRAINER",
    "TARGETS",
    "V1_TRAINER_BASE",
    "V1_UTILS",
    "PatchError",
]
