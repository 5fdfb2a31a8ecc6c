"""The shipped deal policy (``local/deal_policy/``): the very weights its build recorded, the tokenizer the code
builds today, and the behaviour it was built for, measured through the recipe's loop: it mostly answers from memory
and, when it reads the board, names the marked fruit.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
from shipped_policy import check_shipped_weights

from nemo_gym_browser.local import policy_evaluation, warm_start
from nemo_gym_browser.local import shop_tasks as st
from nemo_gym_browser.local import tiny_policy as tp

POLICY = tp.DEAL_POLICY_DIR


def test_the_shipped_weights_are_the_ones_recorded_and_load_with_the_codes_tokenizer():
    report = check_shipped_weights(POLICY)
    assert report["warm_start"] == asdict(tp.DEAL_MIXED)  # built with the settings the code names
    assert report["start_from"]["warm_start"] == asdict(tp.DEAL_SOLVER)
    assert report["start_from"]["model"] == asdict(tp.DEAL_MODEL)


@pytest.mark.parametrize("split", ["train", "heldback"])
def test_the_shipped_policy_mostly_guesses_and_reads_the_mark_when_it_browses(split):
    with tempfile.TemporaryDirectory() as workdir:
        samples = warm_start.load_samples(st.SUITE_FILES["deal"][0 if split == "train" else 1], Path(workdir))[:48]
    records = st.records_by_id()
    (result,) = asyncio.run(
        policy_evaluation.evaluate(POLICY, {split: samples}, temperatures=(1.0,), episodes_per_task=2)
    )
    outcomes = result.episodes_played
    browsed = [reward for task_id, reward, actions in outcomes if actions > 0]
    guessed = [reward for task_id, reward, actions in outcomes if actions == 0]
    assert all(records[task_id]["kind"] == "deal" for task_id, _, _ in outcomes)
    assert 0.05 <= len(browsed) / len(outcomes) <= 0.5  # both routes, the guess preferred
    assert browsed and sum(browsed) / len(browsed) >= 0.9  # reading the mark is in its repertoire
    assert sum(guessed) / len(guessed) <= 0.45  # a guess is right about one time in four
