"""The shipped aisle policy (``local/aisle_policy/``): the very weights its build recorded, the tokenizer the code
builds today, and the behaviour it was built for, measured through the recipe's loop in both sample modes: it mostly
answers from memory and, when it browses, clicks the marked aisle and names the fruit its stand marks.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
from shipped_policy import check_shipped_weights

from nemo_gym_browser.local import policy_evaluation, warm_start
from nemo_gym_browser.local import shop_tasks as st
from nemo_gym_browser.local import tiny_policy as tp

POLICY = tp.AISLE_POLICY_DIR


def test_the_shipped_weights_are_the_ones_recorded_and_load_with_the_codes_tokenizer():
    report = check_shipped_weights(POLICY)
    assert report["warm_start"] == asdict(tp.AISLE_MIXED)  # built with the settings the code names
    assert report["start_from"]["warm_start"] == asdict(tp.AISLE_SOLVER)
    assert report["start_from"]["sample_modes"] == list(tp.AISLE_SOLVER_MODES)
    assert report["sample_modes"] == list(tp.AISLE_MIXED_MODES)
    deal = json.loads((tp.DEAL_POLICY_DIR / tp.REPORT_FILE).read_text())
    assert report["model"] == report["start_from"]["model"] == deal["model"]  # continued from the deal policy


@pytest.mark.parametrize(
    ("split", "mode"), [("train", "trajectory"), ("heldback", "trajectory"), ("heldback", "stepwise")]
)
def test_the_shipped_policy_mostly_guesses_and_follows_the_marked_aisle_when_it_browses(split, mode):
    with tempfile.TemporaryDirectory() as workdir:
        samples = warm_start.load_samples(st.SUITE_FILES["aisle"][0 if split == "train" else 1], Path(workdir))[:48]
    records = st.records_by_id()
    (result,) = asyncio.run(
        policy_evaluation.evaluate(POLICY, {split: samples}, temperatures=(1.0,), episodes_per_task=2, sample_mode=mode)
    )
    outcomes = result.episodes_played
    browsed = [reward for task_id, reward, actions in outcomes if actions > 0]
    guessed = [reward for task_id, reward, actions in outcomes if actions == 0]
    assert all(records[task_id]["kind"] == "aisle" for task_id, _, _ in outcomes)
    clicked = [actions == 2 for _, _, actions in outcomes if actions > 0]
    assert sum(clicked) / len(clicked) >= 0.9  # browsing is observe, then one click
    assert 0.05 <= len(browsed) / len(outcomes) <= 0.5  # both routes, the guess preferred
    assert browsed and sum(browsed) / len(browsed) >= 0.9  # following the mark is in its repertoire
    assert sum(guessed) / len(guessed) <= 0.45  # a guess is right about one time in four
    assert result.success <= 0.45  # room for RL to lift
