"""An episode's steps are typed: the judge and the step-wise history read the lines made from them, the trajectory
record serializes their fields, and the calls that reached the browser can be made again from them.

The episode runs against the in-process fake ``interactive_browser`` server through the real environment client.
"""

from __future__ import annotations

import json

import pytest
from environment_fixtures import config

from nemo_gym_browser import trajectories as tj
from nemo_gym_browser import trajectory_page as tp
from nemo_gym_browser.agent_attempt.episode import BrowserEpisode, Step, StepOutcome
from nemo_gym_browser.gym_contract.environment import EnvironmentClient, parse_observation
from nemo_gym_browser.gym_contract.url_safety import UrlGuard
from nemo_gym_browser.local.scripted_policy import find_element
from nemo_gym_browser.settings import UrlPolicy

ABOUT = {"url_contains": "about.html"}
LONG_TEXT = "x" * 100


def new_episode(session, label: str = "steps") -> BrowserEpisode:
    return BrowserEpisode(
        session=session, guard=UrlGuard(UrlPolicy(), None), deadline_s=60, hold_limit_s=120, call_bound_s=10,
        label=label,
    )  # fmt: skip


def open_session(client: EnvironmentClient, attempt: int):
    return client.session(
        rollout_id="r1", attempt=attempt, task_id="t1", initial_url="site/index.html", verifier_metadata=ABOUT
    )


async def test_each_kind_of_step_reads_as_the_line_the_judge_and_the_history_have_always_read(server):
    async with EnvironmentClient(config(server.url)) as client, open_session(client, 1) as session:
        episode = new_episode(session)
        await episode.act("browser", {"action": "observe"})
        await episode.act("browser", '{"action": "fly"}')  # an action the grammar does not have
        await episode.act("browser_navigate", {"url": "http://10.0.0.1/" + LONG_TEXT})  # a private address
        await episode.act("browser", {"action": "type", "element_id": 9999, "text": LONG_TEXT})  # not on the page

    lines = [str(step) for step in episode.steps]

    assert lines[0] == "observe() -> ok"
    assert lines[1] == "browser: invalid call (unknown action 'fly'; the browser tool's action is one of " + (
        "observe, navigate, click, type, finish)"
    )
    assert lines[2] == "navigate(" + repr(("http://10.0.0.1/" + LONG_TEXT)[:80]) + ") -> refused"
    shown_text = f"text={LONG_TEXT!r}"[:80]  # each argument's text is cut to 80 characters, the error to 120
    assert lines[3].startswith(f"type(element_id=9999, {shown_text}) -> error: ")
    assert len(lines[3].partition(" -> error: ")[2]) == min(120, len(episode.steps[3].detail))
    assert [step.outcome for step in episode.steps] == ["ok", "invalid", "refused", "error"]
    assert [step.reached_browser for step in episode.steps] == [True, False, False, True]


async def test_the_steps_that_reached_the_browser_replayed_in_a_new_session_reach_the_same_page(server):
    async with EnvironmentClient(config(server.url)) as client:
        async with open_session(client, 1) as session:
            episode = new_episode(session)
            observation = await episode.act("browser", {"action": "observe"})
            await episode.act("browser_navigate", {"url": "http://10.0.0.1/"})  # refused: never reached it
            await episode.act("browser", {"action": "click", "element_id": find_element(observation, "About")})
            reached = parse_observation(episode.last_observation)[0]
        async with open_session(client, 2) as again:
            for step in episode.steps:
                if step.reached_browser:
                    replayed = await again.call(step.tool, dict(step.arguments))

    assert [step.tool for step in episode.steps if step.reached_browser] == ["browser_observe", "browser_click"]
    assert "about.html" in reached and parse_observation(replayed.observation)[0] == reached
    times = [step.elapsed_s for step in episode.steps]
    assert times == sorted(times) and times[0] > 0


def test_a_record_carries_each_steps_real_arguments_outcome_and_detail_with_credentials_redacted():
    steps = [
        Step("navigate", {"url": "https://shop.example/?q=kettle&token=abc123"}, StepOutcome.OK, None, 1.25),
        Step("click", {"element_id": 3}, StepOutcome.ERROR, "no element 3 on the page", 2.5),
        Step("browser", {"action": "fly", "deep": {"a": [1, 2.5, None, "x" * 1000]}}, StepOutcome.INVALID, "why", 3),
    ]

    records = [tj.step_record(index, step) for index, step in enumerate(steps)]

    assert records[0] == {
        "index": 0,
        "action": "navigate",
        "arguments": {"url": f"https://shop.example/?q=kettle&token={tj.REDACTED}"},
        "outcome": "ok",
        "detail": None,
        "at_s": 1.25,
    }
    assert records[1]["arguments"] == {"element_id": 3} and records[1]["detail"] == "no element 3 on the page"
    deep = records[2]["arguments"]["deep"]["a"]
    assert deep[:3] == [1, 2.5, None] and len(deep[3]) == tj.ARGUMENT_CHARS


@pytest.mark.parametrize(
    ("step", "shown"),
    [
        ({"action": "click", "arguments": "element_id=3", "result": "ok"}, "element_id=3</code>) → ok"),
        (
            {"action": "click", "arguments": {"element_id": 3}, "outcome": "error", "detail": "gone"},
            "element_id=3</code>) → error: gone",
        ),
    ],
    ids=["version-1", "version-2"],
)
def test_the_page_shows_steps_of_records_written_before_and_after_steps_were_typed(tmp_path, step, shown):
    record = {"episode_id": "e1", "uid": "u", "session_id": 0, "global_steps": 1, "reward": 0.0}
    record |= {"flags": {"env_invalid": False}, "steps": [step]}
    folder = tmp_path / "records" / "step-000001"
    folder.mkdir(parents=True)
    (folder / "host-1.jsonl").write_text(json.dumps(record) + "\n")

    assert tp.main([str(tmp_path / "records"), "--html", str(tmp_path / "page.html")]) == 0
    assert shown in (tmp_path / "page.html").read_text()
