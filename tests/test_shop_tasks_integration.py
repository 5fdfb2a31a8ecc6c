"""The Corner Shop on the real nemo-gym 0.7.0 server with Chromium: the fake server's copy of the site shows every
page exactly as Chromium does, and one task of each kind is solved through the recipe's loop with reward 1.0.

The shop is the session's ``shop_site`` (tests/integration_fixtures.py): one server on the fixed port its task files
name, shared with every other test that needs it.
"""

from __future__ import annotations

import pytest

from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local import shop_scripts
from nemo_gym_browser.local import shop_tasks as st
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.in_process_loop import build_loop
from nemo_gym_browser.local.warm_start import load_samples
from nemo_gym_browser.settings import EnvironmentConfig

pytestmark = pytest.mark.integration

ENVIRONMENT = {"call_timeout_s": 30.0, "seed_timeout_s": 60.0, "verify_timeout_s": 30.0, "close_timeout_s": 15.0}


def named(observation: str, name: str, tag: str = "a") -> int:
    return next(
        eid
        for eid, element_tag, element_name in shop_scripts.elements(observation)
        if (element_tag, element_name) == (tag, name)
    )


async def tour(server_url: str) -> list[str]:
    """Every page of the shop by clicks in one session, then a search: the observation after each action."""
    seen = []
    config = EnvironmentConfig(server_urls=(server_url,), **ENVIRONMENT)
    async with EnvironmentClient(config) as client:
        home = st.page_url("index.html")
        async with client.session(rollout_id="tour", attempt=0, task_id="tour", initial_url=home) as session:
            page = (await session.observe()).observation
            seen.append(page)
            for section, entries in st.CATEGORIES.items():
                page = (await session.click(named(page, section))).observation
                seen.append(page)
                for name, _ in entries:
                    page = (await session.click(named(page, name))).observation
                    seen.append(page)
                    page = (await session.click(named(page, f"Back to {section}"))).observation
                page = (await session.click(named(page, "Home"))).observation
            box = next(eid for eid, tag, _ in shop_scripts.elements(page) if tag == "input")
            page = (await session.type(box, "Mango")).observation
            page = (await session.click(named(page, "Search", "button"))).observation
            seen.append(page)
    return seen


async def test_the_fake_shop_shows_every_page_as_chromium_renders_the_real_one(real_environment, shop_site):
    async with InProcessEnvironmentServer(site=st.in_process_site()) as fake:
        expected = await tour(fake.url)
    actual = await tour(real_environment.url)
    assert len(actual) == 1 + len(st.CATEGORIES) + len(st.items()) + 1
    assert actual == expected
    assert "Results for: Mango" in actual[-1]


async def test_one_task_of_each_kind_is_solved_on_the_real_server_and_a_wrong_price_scores_zero(
    real_environment, shop_site, tokenizer, tools, trainer_config, tmp_path
):
    records = {record["id"]: record for record in st.task_records("heldback")}
    samples = load_samples(st.HELD_BACK_FILE, tmp_path)
    chosen = {}
    for sample in samples:
        kind = records[sample["extra_info"]["task_id"]]["kind"]
        chosen.setdefault(kind, sample)
    rewards = {}
    try:
        for kind, sample in chosen.items():
            record = records[sample["extra_info"]["task_id"]]
            for wrong in (False, True) if kind == "price" else (False,):
                loop = build_loop(
                    sp.ScriptedPolicy(tokenizer, shop_scripts.script_for(record, wrong_answer=wrong)),
                    tokenizer=tokenizer,
                    tools=tools,
                    trainer_config=trainer_config,
                    environment={"server_urls": [real_environment.url], **ENVIRONMENT},
                    resample_backoff_s=0.2,
                )
                output = await loop.run({}, **sample)
                assert output.extra_fields["env_invalid"] is False, output.extra_fields
                rewards[(kind, wrong)] = output.reward_score
    finally:
        await close_shared_clients()
    assert rewards == {**{(kind, False): 1.0 for kind in st.KINDS}, ("price", True): 0.0}


async def boards(server_url: str) -> list[str]:
    """Twelve deal boards and a bad board number, navigated to in one session: the observation of each."""
    config = EnvironmentConfig(server_urls=(server_url,), **ENVIRONMENT)
    first, *others = [st.page_url(board.file) for board in st.deal_boards()[:12]] + [st.page_url("deals.html?board=")]
    async with EnvironmentClient(config) as client:
        async with client.session(rollout_id="deals", attempt=0, task_id="deals", initial_url=first) as session:
            seen = [(await session.observe()).observation]
            for url in others:
                seen.append((await session.navigate(url)).observation)
    return seen


async def test_the_deal_boards_render_as_in_chromium_and_a_deal_is_read_or_guessed_on_the_real_server(
    real_environment, shop_site, tokenizer, tools, trainer_config, tmp_path
):
    async with InProcessEnvironmentServer(site=st.in_process_site()) as fake:
        expected = await boards(fake.url)
    actual = await boards(real_environment.url)
    assert actual == expected and len(actual) == 13
    assert all(text.count(st.SALE_MARK) == 2 for text in actual[:-1])  # the marked link and the page text

    sample = load_samples(st.DEAL_HELD_BACK_FILE, tmp_path)[0]
    record = st.records_by_id()[sample["extra_info"]["task_id"]]
    outcomes = {}
    try:
        for route, guess in (("browse", 0.0), ("guess", 1.0)):
            loop = build_loop(
                sp.ScriptedPolicy(tokenizer, shop_scripts.deal_script(record, shop_scripts.Chooser(), guess)),
                tokenizer=tokenizer,
                tools=tools,
                trainer_config=trainer_config,
                environment={"server_urls": [real_environment.url], **ENVIRONMENT},
            )
            output = await loop.run({}, **sample)
            assert output.extra_fields["env_invalid"] is False, output.extra_fields
            outcomes[route] = (output.reward_score, output.extra_fields["env_browser_actions"])
    finally:
        await close_shared_clients()
    assert outcomes["browse"] == (1.0, 1)
    assert outcomes["guess"][1] == 0  # answered without the browser, right or wrong


async def aisle_pages(server_url: str) -> list[str]:
    """Eight aisle days, each followed to two of its stands by clicks, then a bad day and a bad aisle: every
    observation."""
    config = EnvironmentConfig(server_urls=(server_url,), **ENVIRONMENT)
    days = st.aisle_days()[:8]
    seen = []
    async with EnvironmentClient(config) as client:
        start = st.page_url(days[0].file)
        async with client.session(rollout_id="aisles", attempt=0, task_id="aisles", initial_url=start) as session:
            for index, day in enumerate(days):
                shown = session.observe() if index == 0 else session.navigate(st.page_url(day.file))
                page = (await shown).observation
                seen.append(page)
                for aisle in (day.deal_aisle, day.order[-1] if day.order[-1] != day.deal_aisle else day.order[0]):
                    seen.append((await session.click(named(page, day.label(aisle)))).observation)
                    page = (await session.navigate(st.page_url(day.file))).observation
            for bad in ("aisles.html?day=x", "aisle.html?day=1&aisle=fruit"):
                seen.append((await session.navigate(st.page_url(bad))).observation)
    return seen


async def test_the_aisle_pages_render_as_in_chromium_and_an_aisle_task_is_solved_by_clicking_on_the_real_server(
    real_environment, shop_site, tokenizer, tools, stepwise_trainer_config, tmp_path
):
    async with InProcessEnvironmentServer(site=st.in_process_site()) as fake:
        expected = await aisle_pages(fake.url)
    actual = await aisle_pages(real_environment.url)
    assert actual == expected and len(actual) == 8 * 3 + 2
    starts, stands = actual[:-2:3], [page for i, page in enumerate(actual[:-2]) if i % 3]
    assert all(text.count(st.DEAL_MARK) == 2 for text in starts)  # the marked link and the page text
    assert all(text.count(st.SALE_MARK) == 2 for text in stands)

    sample = load_samples(st.AISLE_HELD_BACK_FILE, tmp_path)[0]
    record = st.records_by_id()[sample["extra_info"]["task_id"]]
    outcomes = {}
    try:
        for route, guess, stepwise in (("browse", 0.0, False), ("browse-stepwise", 0.0, True), ("guess", 1.0, False)):
            loop = build_loop(
                sp.ScriptedPolicy(tokenizer, shop_scripts.aisle_script(record, shop_scripts.Chooser(), guess)),
                tokenizer=tokenizer,
                tools=tools,
                trainer_config=stepwise_trainer_config,
                environment={"server_urls": [real_environment.url], **ENVIRONMENT},
                stepwise={"enabled": stepwise},
            )
            v1 = {"uid": route, "session_id": 0, "global_steps": 1} if stepwise else {}
            output = await loop.run({}, **sample, **v1)
            final = output[-1] if stepwise else output
            assert final.extra_fields["env_invalid"] is False, final.extra_fields
            outcomes[route] = (final.reward_score, final.extra_fields["env_browser_actions"])
    finally:
        await close_shared_clients()
    assert outcomes["browse"] == (1.0, 2) and outcomes["browse-stepwise"] == (1.0, 2)  # observe, click the mark
    assert outcomes["guess"][1] == 0  # answered without the browser, right or wrong
