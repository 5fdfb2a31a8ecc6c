"""MiniWoB++'s own pages on the real nemo-gym 0.7.0 server with Chromium: the adapter (a seed gives one problem, no
time limit, the first end is kept, a reload replays nothing), the grade (only MiniWoB's raw reward of 1 shows the
completion code, and typing, answering or navigating to the code scores 0), and three tasks graded through the
recipe's loop with the observation-reading solver.

The site runs on its fixed port 8766 (the rows name it) for this module; the environment is the session's.
"""

from __future__ import annotations

import asyncio

import pytest

from nemo_gym_browser.agent_attempt.episode import render_result
from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.local.miniwob import evaluate, grading, pages, suite
from nemo_gym_browser.local.miniwob.site import MiniWobSite, MiniWobSiteBusy
from nemo_gym_browser.local.miniwob.solver import Page
from nemo_gym_browser.settings import EnvironmentConfig

pytestmark = pytest.mark.integration

KEY = grading.GradeKey.generate()
ENVIRONMENT = evaluate.ENVIRONMENT
# MiniWoB's own limit on click-test-2 is core.js's default, 10 s.
BEYOND_MINIWOBS_TIME_LIMIT_S = 10.5


@pytest.fixture(scope="module")
def miniwob_site():
    try:
        site = MiniWobSite(KEY).start()
    except MiniWobSiteBusy as error:
        pytest.fail(str(error), pytrace=False)
    try:
        yield site
    finally:
        site.stop()


class Episode:
    """One seeded browser session driven by hand: every observation is kept, in order."""

    def __init__(self, session) -> None:
        self.session = session
        self.seen: list[str] = []

    async def act(self, tool: str, **arguments) -> Page:
        result = await self.session.call(f"browser_{tool}", arguments)
        self.seen.append(render_result(result))
        return Page.parse(self.seen[-1])


async def run(environment_url: str, site: MiniWobSite, plays: dict[str, tuple[str, int, int, object]]):
    """Each play ``name: (task, seed the browser opens, seed the grade names, coroutine function)`` in its own
    session, all at once; a play is called with the episode, the site and the graded code. Returns
    ``{name: (reward, observations)}``."""
    config = EnvironmentConfig(server_urls=(environment_url,), **ENVIRONMENT)
    async with EnvironmentClient(config) as client:

        async def one(name: str, task: str, opened: int, graded: int, play) -> tuple[float, list[str]]:
            async with client.session(
                rollout_id=f"miniwob-{name}",
                attempt=0,
                task_id=task,
                initial_url=site.task_url(task, opened),
                verifier_metadata=grading.verifier_metadata(KEY, task, graded),
            ) as session:
                episode = Episode(session)
                await play(episode, site, KEY.completion_code(task, graded))
                return (await session.verify()).reward, episode.seen

        results = await asyncio.gather(*(one(name, *play) for name, play in plays.items()))
    return dict(zip(plays, results, strict=True))


def named_button(page: Page) -> str:
    return page.find(r"Click button (\w+)\.").group(1)


async def solve_after_the_time_limit_then_click_more(episode: Episode, site: MiniWobSite, code: str) -> None:
    first = await episode.act("observe")
    await asyncio.sleep(BEYOND_MINIWOBS_TIME_LIMIT_S)
    assert (await episode.act("observe")).text == first.text
    right = first.one("button", named_button(first))
    solved = await episode.act("click", element_id=right.id)
    wrong = next(element for element in solved.all("button") if element.name != right.name)
    await episode.act("click", element_id=wrong.id)
    await episode.act("finish", answer="done")
    await episode.act("navigate", url=site.task_url("click-test-2", 4))  # after finishing: not graded


async def click_wrong_then_right(episode: Episode, site: MiniWobSite, code: str) -> None:
    first = await episode.act("observe")
    right = first.one("button", named_button(first))
    wrong = next(element for element in first.all("button") if element.name != right.name)
    await episode.act("click", element_id=wrong.id)
    await episode.act("click", element_id=right.id)


async def reload_then_click_right(episode: Episode, site: MiniWobSite, code: str) -> None:
    first = await episode.act("observe")
    again = await episode.act("navigate", url=site.task_url("click-test-2", 4))
    if again.all("button"):
        await episode.act("click", element_id=again.one("button", named_button(first)).id)


async def test_a_seed_gives_one_problem_with_no_time_limit_and_the_first_end_stays_on_the_page(
    real_environment, miniwob_site
):
    outcomes = await run(
        real_environment.url,
        miniwob_site,
        {
            "late": ("click-test-2", 4, 4, solve_after_the_time_limit_then_click_more),
            "wrong-first": ("click-test-2", 4, 4, click_wrong_then_right),
            "reload": ("click-test-2", 4, 4, reload_then_click_right),
        },
    )
    code = KEY.completion_code("click-test-2", 4)
    late_reward, late = outcomes["late"]
    assert late_reward == 1.0
    assert all(code not in seen for seen in late[:2]) and "Episode over" not in late[1]
    assert f"Episode over. MiniWoB reward: 1.00. {grading.CODE_LABEL}: {code}" in late[2]
    assert Page.parse(late[3]).text == Page.parse(late[2]).text  # a later click scores nothing and makes nothing new
    assert pages.ALREADY_RAN in late[-1]

    wrong_reward, wrong = outcomes["wrong-first"]
    assert wrong[0] == late[0]  # the same seed, the same problem
    assert wrong_reward == 0.0 and "Episode over. MiniWoB reward: -1.00." in wrong[-1]
    assert all(code not in seen for seen in wrong)

    reload_reward, reloaded = outcomes["reload"]
    assert reload_reward == 0.0 and pages.ALREADY_RAN in reloaded[1] and code not in "".join(reloaded)


async def type_the_code_everywhere(episode: Episode, site: MiniWobSite, code: str) -> None:
    page = await episode.act("observe")
    for field in page.all("input") + page.all("textarea"):
        page = await episode.act("type", element_id=field.id, text=f"{grading.CODE_LABEL}: {code}")
    await episode.act("finish", answer="done")


async def answer_the_code(episode: Episode, site: MiniWobSite, code: str) -> None:
    await episode.act("observe")
    await episode.act("finish", answer=code)


async def open_urls_naming_the_code(episode: Episode, site: MiniWobSite, code: str) -> None:
    for path in (f"/miniwob/{code}.html?seed=9", f"/miniwob/enter-text.html?seed=9&code={code}", f"/core/{code}.js"):
        await episode.act("navigate", url=site.url + path)


async def solve_another_seed(episode: Episode, site: MiniWobSite, code: str) -> None:
    page = await episode.act("observe")
    text = page.find(r'Enter "(.+?)" into the text field').group(1)
    await episode.act("type", element_id=page.one("input").id, text=text)
    await episode.act("click", element_id=page.one("button", "Submit").id)


async def test_typing_answering_or_opening_the_code_and_solving_another_problem_all_score_zero(
    real_environment, miniwob_site
):
    plays = {
        "type": ("copy-paste", 9, 9, type_the_code_everywhere),
        "type-enter-text": ("enter-text", 9, 9, type_the_code_everywhere),
        "answer": ("enter-text", 9, 9, answer_the_code),
        "navigate": ("enter-text", 9, 9, open_urls_naming_the_code),
        "other-seed": ("enter-text", 14, 9, solve_another_seed),
    }
    outcomes = await run(real_environment.url, miniwob_site, plays)
    assert {name: reward for name, (reward, _) in outcomes.items()} == dict.fromkeys(outcomes, 0.0)
    graded = {name: KEY.completion_code(task, seed) for name, (task, _, seed, _) in plays.items()}
    for name, (_, observations) in outcomes.items():
        shown = [Page.parse(seen) for seen in observations]
        assert not any(graded[name] in page.title + " " + page.text for page in shown), name
    assert KEY.completion_code("enter-text", 14) in outcomes["other-seed"][1][-1]  # solved, but another problem
    assert len(outcomes["type"][1]) >= 4  # two text areas or fields at least, then the finish


async def test_three_tasks_are_solved_through_the_recipes_loop_and_finishing_at_once_scores_zero(
    real_environment, miniwob_site, tmp_path
):
    tasks = ["click-checkboxes", "enter-password", "click-dialog-2"]
    rows = suite.write_rows(KEY, tmp_path, per_task={"heldback": 1}, tasks=tasks)
    samples = evaluate.load_samples(rows["heldback"])
    solved = await evaluate.play(samples, real_environment.url, policy="solver")
    at_once = await evaluate.play(samples, real_environment.url, policy="finish-at-once")
    assert [(episode.task, episode.reward, episode.invalid) for episode in solved] == [
        (task, 1.0, False) for task in tasks
    ]
    assert all(episode.calls >= 2 for episode in solved)
    assert [(episode.reward, episode.calls) for episode in at_once] == [(0.0, 0)] * 3
