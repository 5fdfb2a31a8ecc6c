"""grpo_env_aware against a plain reference, the NeMo RL reference case, and verl's own GRPO (bit for bit)."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos

from nemo_gym_browser import group_stats

EPSILON = 1e-6


def reference_advantages(
    scores: list[float], groups: list[int], invalid: list[bool], *, norm: bool, epsilon: float = EPSILON
) -> list[float]:
    """The definition, one sample at a time, in float64."""
    out = [0.0] * len(scores)
    for group in set(groups):
        members = [i for i, g in enumerate(groups) if g == group and not invalid[i]]
        if len(members) < 2:
            continue
        mean = sum(scores[i] for i in members) / len(members)
        std = math.sqrt(sum((scores[i] - mean) ** 2 for i in members) / (len(members) - 1))
        for i in members:
            out[i] = (scores[i] - mean) / (std + epsilon) if norm else scores[i] - mean
    return out


def outcome_rewards(scores: torch.Tensor, length: int, generator: torch.Generator) -> torch.Tensor:
    """Token-level rewards holding each score on a random token, as verl's reward managers do (last valid token)."""
    rewards = torch.zeros(len(scores), length, dtype=scores.dtype)
    positions = torch.randint(0, length, (len(scores),), generator=generator)
    rewards[torch.arange(len(scores)), positions] = scores
    return rewards


def random_batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 17, (int(torch.randint(1, 12, (1,), generator=generator)),), generator=generator)
    groups = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    groups = groups[torch.randperm(len(groups), generator=generator)]  # members of a group are not adjacent
    n = len(groups)
    if seed % 2:
        scores = torch.randint(0, 5, (n,), generator=generator).float() / 4  # ties and equal groups
    else:
        scores = torch.rand(n, generator=generator) * 3 - 1
    invalid = torch.rand(n, generator=generator) < float(torch.rand(1, generator=generator))
    length = int(torch.randint(1, 6, (1,), generator=generator))
    mask = (torch.rand(n, length, generator=generator) < 0.8).long()
    uids = np.array([f"uid-{int(g)}" for g in groups], dtype=object)
    return {
        "scores": scores,
        "groups": groups,
        "uids": uids,
        "invalid": invalid,
        "rewards": outcome_rewards(scores, length, generator),
        "mask": mask,
    }


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32 if tensor.dtype == torch.float32 else torch.int64)


def test_reference_case_gives_valid_samples_mean_centred_advantages_without_the_invalid_zero():
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 0.0, 0.0])
    advantages, returns = group_stats.compute_grpo_env_aware_advantage(
        rewards,
        torch.ones(4, 3),
        np.array(["prompt"] * 4, dtype=object),
        norm_adv_by_std_in_grpo=False,
        env_invalid=np.array([False, True, False, False]),
    )
    expected = torch.tensor([2 / 3, 0.0, -1 / 3, -1 / 3]).unsqueeze(-1).expand(4, 3)
    torch.testing.assert_close(advantages, expected)
    assert returns is advantages


@pytest.mark.parametrize("norm", [True, False], ids=["std", "no-std"])
def test_agrees_with_the_plain_definition_on_random_batches_with_random_flags(norm):
    for seed in range(150):
        batch = random_batch(seed)
        advantages, _ = group_stats.compute_grpo_env_aware_advantage(
            batch["rewards"],
            batch["mask"],
            batch["uids"],
            norm_adv_by_std_in_grpo=norm,
            env_invalid=batch["invalid"].numpy(),
        )
        expected = reference_advantages(
            batch["scores"].double().tolist(), batch["groups"].tolist(), batch["invalid"].tolist(), norm=norm
        )
        expected = torch.tensor(expected, dtype=torch.float32).unsqueeze(-1) * batch["mask"]
        torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


@pytest.mark.parametrize("norm", [True, False], ids=["std", "no-std"])
def test_without_flags_matches_verl_grpo_bit_for_bit_on_every_group_of_two_or_more(norm):
    singletons_seen = 0
    for seed in range(300):
        batch = random_batch(seed)
        ours, _ = group_stats.compute_grpo_env_aware_advantage(
            batch["rewards"], batch["mask"], batch["uids"], norm_adv_by_std_in_grpo=norm
        )
        stock, _ = core_algos.compute_grpo_outcome_advantage(
            batch["rewards"].clone(), batch["mask"], batch["uids"], norm_adv_by_std_in_grpo=norm
        )
        sizes = torch.bincount(batch["groups"])[batch["groups"]]
        shared = sizes >= 2
        assert torch.equal(bits(ours[shared]), bits(stock[shared])), f"seed {seed}"
        assert torch.count_nonzero(ours[~shared]) == 0
        singletons_seen += int((~shared).sum())
    assert singletons_seen > 0  # the group-of-one rule was exercised


def test_matches_verl_grpo_bit_for_bit_on_float32_rewards_where_torch_std_is_most_fragile():
    # Nearly equal members make the variance a cancellation; both std algorithms must round the same way.
    generator = torch.Generator().manual_seed(7)
    for size in (2, 3, 8, 16):
        base = torch.randn(4000, 1, generator=generator) * 5
        scores = (base + torch.randn(4000, size, generator=generator) * 1e-3).reshape(-1)
        uids = np.repeat(np.arange(4000), size)
        rewards = scores.unsqueeze(-1)
        mask = torch.ones_like(rewards)
        ours, _ = group_stats.compute_grpo_env_aware_advantage(rewards, mask, uids)
        stock, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, uids)
        assert torch.equal(bits(ours), bits(stock)), f"group size {size}"


def test_float64_rewards_agree_with_verl_grpo_to_rounding():
    batch = random_batch(4)
    rewards = batch["rewards"].double()
    ours, _ = group_stats.compute_grpo_env_aware_advantage(rewards, batch["mask"], batch["uids"])
    stock, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), batch["mask"], batch["uids"])
    shared = (torch.bincount(batch["groups"]) >= 2)[batch["groups"]]
    torch.testing.assert_close(ours[shared], stock[shared], rtol=1e-12, atol=1e-12)


def test_group_labels_may_be_strings_integers_or_a_tensor():
    batch = random_batch(11)
    as_strings, _ = group_stats.compute_grpo_env_aware_advantage(
        batch["rewards"], batch["mask"], batch["uids"], env_invalid=batch["invalid"]
    )
    as_numpy, _ = group_stats.compute_grpo_env_aware_advantage(
        batch["rewards"], batch["mask"], batch["groups"].numpy(), env_invalid=batch["invalid"]
    )
    as_tensor, _ = group_stats.compute_grpo_env_aware_advantage(
        batch["rewards"], batch["mask"], batch["groups"], env_invalid=batch["invalid"]
    )
    assert torch.equal(as_strings, as_numpy)
    assert torch.equal(as_strings, as_tensor)
    assert torch.count_nonzero(as_strings) > 0


def test_flags_may_be_bools_python_lists_or_object_arrays_with_missing_entries():
    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.5]])
    uids = np.array(["a", "a", "a", "a"], dtype=object)
    with_none = np.empty(4, dtype=object)
    with_none[:] = [None, True, np.False_, None]  # None: that sample's agent loop set no flag (valid)
    results = [
        group_stats.compute_grpo_env_aware_advantage(rewards, torch.ones(4, 1), uids, env_invalid=flags)[0]
        for flags in (with_none, [False, True, False, False], torch.tensor([0, 1, 0, 0]), np.array([0, 1, 0, 0]))
    ]
    for result in results[1:]:
        assert torch.equal(result, results[0])
    assert results[0][1].item() == 0.0
    assert torch.count_nonzero(results[0]) == 3


def test_invalid_samples_and_groups_left_with_one_valid_sample_get_zero():
    rewards = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0], [0.3]])
    uids = np.array(["a", "a", "b", "b", "c", "d"], dtype=object)
    invalid = np.array([False, True, True, True, False, False])
    advantages, _ = group_stats.compute_grpo_env_aware_advantage(rewards, torch.ones(6, 1), uids, env_invalid=invalid)
    assert torch.count_nonzero(advantages) == 0  # a: one valid; b: none; c and d: groups of one


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_score_is_left_out_of_its_group_instead_of_spreading_to_every_advantage(bad):
    uids = np.array(["a", "a", "a", "a", "b", "b"], dtype=object)
    rewards = torch.tensor([[1.0], [bad], [0.0], [1.0], [0.0], [1.0]])
    advantages, _ = group_stats.compute_grpo_env_aware_advantage(rewards, torch.ones(6, 1), uids)
    flagged, _ = group_stats.compute_grpo_env_aware_advantage(
        torch.nan_to_num(rewards, nan=0.0, posinf=0.0, neginf=0.0),
        torch.ones(6, 1),
        uids,
        env_invalid=[False, True, False, False, False, False],
    )
    assert torch.isfinite(advantages).all()
    assert torch.equal(advantages, flagged)  # exactly as if the sample had been flagged invalid
    assert advantages[1].item() == 0.0 and torch.count_nonzero(advantages) == 5


def test_flag_count_must_match_the_batch():
    with pytest.raises(ValueError, match="3 entries for 2 samples"):
        group_stats.compute_grpo_env_aware_advantage(
            torch.ones(2, 1), torch.ones(2, 1), np.array([0, 0]), env_invalid=[False, False, True]
        )


def test_normalisation_falls_back_to_the_algorithm_config_when_not_passed():
    rewards = torch.tensor([[1.0], [0.0], [0.0]])
    uids = np.zeros(3, dtype=np.int64)
    from_config, _ = group_stats.compute_grpo_env_aware_advantage(
        rewards, torch.ones(3, 1), uids, config={"norm_adv_by_std_in_grpo": False}
    )
    explicit, _ = group_stats.compute_grpo_env_aware_advantage(
        rewards, torch.ones(3, 1), uids, norm_adv_by_std_in_grpo=False
    )
    normalised, _ = group_stats.compute_grpo_env_aware_advantage(rewards, torch.ones(3, 1), uids)
    assert torch.equal(from_config, explicit)
    assert not torch.equal(from_config, normalised)


def test_estimator_is_registered_with_verl_and_survives_a_module_reload():
    assert core_algos.get_adv_estimator_fn("grpo_env_aware") is group_stats.compute_grpo_env_aware_advantage
    reloaded = importlib.reload(group_stats)
    assert core_algos.get_adv_estimator_fn("grpo_env_aware") is reloaded.compute_grpo_env_aware_advantage
    reloaded.register()  # again: a no-op
    assert core_algos.get_adv_estimator_fn("grpo_env_aware") is reloaded.compute_grpo_env_aware_advantage


def test_registration_refuses_to_replace_someone_elses_estimator_of_the_same_name(monkeypatch):
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "grpo_env_aware", core_algos.compute_rloo_outcome_advantage)
    with pytest.raises(ValueError, match="already been registered"):
        group_stats.register()
