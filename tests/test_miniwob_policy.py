"""The MiniWoB++ tiny policy offline: the tasks it learns, the demonstrations' player (the solver, clicking its
element only some of the time) and the shipped folder.

The demonstrations themselves are played on Chromium by ``python -m nemo_gym_browser.local.miniwob.policy``.
"""

from __future__ import annotations

import json

import pytest
from shipped_policy import check_shipped_weights

from nemo_gym_browser.local import tiny_policy
from nemo_gym_browser.local.chat_tokenizer import TOOL_RESPONSE_END, TOOL_RESPONSE_START
from nemo_gym_browser.local.miniwob import inventory, policy, solver

CLICK_BUTTON = "\n".join(
    [
        "URL: http://127.0.0.1:8766/miniwob/click-button.html?seed={seed}",
        "TITLE: Click Button Task",
        "ELEMENTS:",
        "  [0] button: no",
        "  [1] button: Cancel",
        "  [2] button: submit",
        "  [3] button: ok",
        "TEXT:",
        '  Click on the "submit" button. no Cancel submit ok',
    ]
)


class View:
    """What a scripted-policy script reads: the conversation so far."""

    def __init__(self, *answers: str) -> None:
        self.text = "<|im_start|>user\nTask: ...<|im_end|>" + "".join(
            f"{TOOL_RESPONSE_START}\n{answer}\n{TOOL_RESPONSE_END}" for answer in answers
        )


def clicked(script, seed: int) -> int:
    call = json.loads(script(View(CLICK_BUTTON.format(seed=seed))).split("\n")[1])
    assert call["arguments"]["action"] == "click"
    return call["arguments"]["element_id"]


def test_the_learning_tasks_are_included_tasks_the_solver_plays_with_two_browser_calls():
    assert len(policy.LEARNING_TASKS) >= 8
    assert set(policy.LEARNING_TASKS) <= set(inventory.included_tasks()) & set(solver.SOLVERS)
    measured = json.loads((policy.MINIWOB_POLICY_DIR.parent.parent / "bench" / "miniwob_solver.json").read_text())
    assert all(measured["tasks"][task]["mean_browser_calls"] == 2.0 for task in policy.LEARNING_TASKS)


def test_a_demonstration_observes_first_then_clicks_the_solvers_element_only_as_often_as_asked():
    always, never = policy.demonstration_script(1.0, seed=0), policy.demonstration_script(0.0, seed=0)
    assert json.loads(always(View()).split("\n")[1])["arguments"] == {"action": "observe"}
    assert json.loads(never(View()).split("\n")[1])["arguments"] == {"action": "observe"}  # the format is kept
    assert {clicked(always, seed) for seed in range(40)} == {2}
    # else any listed element, the right one included: every one of the four turns up over 40 problems
    assert {clicked(never, seed) for seed in range(40)} == {0, 1, 2, 3}
    half = policy.demonstration_script(0.5, seed=0)
    right = sum(clicked(half, seed) == 2 for seed in range(200))
    assert 0.5 + 0.5 / 4 - 0.1 < right / 200 < 0.5 + 0.5 / 4 + 0.1
    # a conversation always gets the same turn; another seed of the player draws again
    assert [clicked(half, seed) for seed in range(40)] == [clicked(half, seed) for seed in range(40)]
    other = policy.demonstration_script(0.5, seed=1)
    assert [clicked(half, seed) for seed in range(40)] != [clicked(other, seed) for seed in range(40)]
    with pytest.raises(ValueError, match="correct"):
        policy.demonstration_script(1.5, seed=0)


def test_after_its_click_ends_the_episode_a_demonstration_finishes():
    over = CLICK_BUTTON.format(seed=3).replace("ok", "ok Episode over. MiniWoB reward: 1.")
    script = policy.demonstration_script(0.0, seed=0)
    call = json.loads(script(View(CLICK_BUTTON.format(seed=3), over)).split("\n")[1])
    assert call["arguments"]["action"] == "finish"


def test_the_shipped_policy_continues_the_aisle_policy_on_demonstrations_of_the_learning_tasks():
    report = check_shipped_weights(policy.MINIWOB_POLICY_DIR)
    assert (
        report["start_from"]["warm_start"]
        == json.loads((tiny_policy.AISLE_POLICY_DIR / tiny_policy.REPORT_FILE).read_text())["warm_start"]
    )
    assert sorted(report["tokens_per_episode"]) == sorted(policy.LEARNING_TASKS)
    assert report["warm_start"]["correct"] == policy.MINIWOB_WARM.correct
    assert report["demonstrations"] >= len(policy.LEARNING_TASKS) * policy.DEMO_SEEDS * 0.9
    # clicking the solver's element one time in two, else any listed one: right more often than half the time
    assert 0.5 < report["demonstration_success"] < 0.9


def test_the_manual_states_the_warm_starts_cost_as_its_report_holds():
    report = json.loads((policy.MINIWOB_POLICY_DIR / tiny_policy.REPORT_FILE).read_text())
    manual = " ".join((policy.MINIWOB_POLICY_DIR.parent.parent / "docs" / "miniwob.md").read_text().split())
    assert f"the warm start's {report['demonstrations']} demonstrations ({policy.DEMO_SEEDS} training seeds" in manual
    stated = f"took {report['demo_seconds'] / 60:.1f} min and its {report['warm_start']['steps']} optimizer steps"
    assert stated + f" {report['train_seconds'] / 60:.1f} min" in manual


def test_the_learning_results_describe_the_warm_start_its_report_holds():
    report = json.loads((policy.MINIWOB_POLICY_DIR / tiny_policy.REPORT_FILE).read_text())
    page = (policy.MINIWOB_POLICY_DIR.parent.parent / "docs" / "learning-results.md").read_text()
    page = " ".join(page.split())
    assert f"continued for {report['warm_start']['steps']} steps on {report['demonstrations']} demonstrations" in page
    assert f"the first {policy.DEMO_SEEDS} training seeds of each task" in page
    assert f"({report['demonstration_success'] * 100:.0f} % of them solved their problem" in page
    assert ", ".join(policy.LEARNING_TASKS[:-1]) + f" and {policy.LEARNING_TASKS[-1]}" in page
