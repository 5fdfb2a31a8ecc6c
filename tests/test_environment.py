"""The environment client against the fake server: lifecycles, every injected fault and its kind, policy errors."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
from environment_fixtures import config

from nemo_gym_browser.gym_contract import rows
from nemo_gym_browser.gym_contract.environment import VERIFIER_KEYS, EnvironmentClient, validate_verifier_metadata
from nemo_gym_browser.gym_contract.failures import EnvironmentFailure, FailureKind
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.settings import EnvironmentConfig

START = "site/index.html"
ABOUT = {"url_contains": "about.html"}


def open_session(client: EnvironmentClient, rollout: str = "r1", verifier=ABOUT, **kwargs):
    return client.session(
        rollout_id=rollout, attempt=0, task_id="t1", initial_url=START, verifier_metadata=verifier, **kwargs
    )


def element_id(observation: str, name: str) -> int:
    for line in observation.splitlines():
        if line.strip().startswith("[") and line.strip().endswith(name):
            return int(line.strip()[1 : line.strip().index("]")])
    raise AssertionError(f"no element {name!r} in {observation!r}")


async def test_a_whole_episode_seeds_acts_verifies_and_closes_in_order(server, client):
    async with open_session(client) as session:
        first = await session.observe()
        assert first.error is None and "TITLE: Home" in first.observation
        clicked = await session.click(element_id(first.observation, "About"))
        assert "about.html" in clicked.observation
        finished = await session.finish("done")
        assert finished.done
        assert (await session.verify()).reward == 1.0
    assert server.events(session.session_id) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert server.open_sessions == 0
    assert await session.is_released()


async def test_a_verifier_that_does_not_match_grades_zero_as_a_valid_result(server, client):
    async with open_session(client, verifier={"url_contains": "form.html"}) as session:
        await session.observe()
        await session.finish("done")
        assert (await session.verify()).reward == 0.0


async def test_concurrent_sessions_on_an_ip_address_host_keep_their_own_cookie(server, client):
    assert "127.0.0.1" in server.url
    async with open_session(client, "ra") as a, open_session(client, "rb") as b:
        home_a = await a.observe()
        await a.click(element_id(home_a.observation, "About"))
        seen_by_b = await b.observe()
        seen_by_a = await a.observe()
    assert "TITLE: Home" in seen_by_b.observation
    assert "TITLE: About" in seen_by_a.observation
    assert server.open_sessions == 0


# ----- infrastructure failures, one kind each ------------------------------------------------------------------


async def test_a_stopped_server_is_unreachable_within_the_connect_budget(server, client):
    await server.stop()
    started = time.monotonic()
    with pytest.raises(EnvironmentFailure) as caught:
        async with open_session(client):
            pass
    assert caught.value.kind is FailureKind.UNREACHABLE
    assert server.url in caught.value.reason
    assert time.monotonic() - started < 4.0  # refused at once: the bound is a loaded machine's slack


async def test_a_seed_whose_start_page_fails_is_seed_failed_and_still_closed(server, client):
    server.inject("seed_session", Fault.fail_seed())
    with pytest.raises(EnvironmentFailure) as caught:
        async with open_session(client):
            pass
    assert caught.value.kind is FailureKind.SEED_FAILED
    assert "ERR_NAME_NOT_RESOLVED" in caught.value.reason
    # The typed close is sent for a failed seed too, so a late seed can never open a browser nobody closes.
    assert server.calls("close_session") == 1
    assert server.open_sessions == 0
    assert server.events(server.session_ids[0]) == ["seed", "close"]


async def test_a_seed_answer_for_another_session_id_is_seed_failed(server, client):
    server.inject("seed_session", Fault.respond({"resources_session_id": "someone-else"}))
    with pytest.raises(EnvironmentFailure) as caught:
        async with open_session(client):
            pass
    assert caught.value.kind is FailureKind.SEED_FAILED


async def test_a_rejected_seed_schema_is_seed_failed_with_the_reason(server, client):
    server.inject(
        "seed_session", Fault.status(422, {"detail": [{"loc": ["body", "task_id"], "msg": "Field required"}]})
    )
    with pytest.raises(EnvironmentFailure) as caught:
        async with open_session(client):
            pass
    assert caught.value.kind is FailureKind.SEED_FAILED
    assert "422" in caught.value.reason


async def test_a_hung_seed_is_seed_failed_within_its_timeout(server):
    server.inject("seed_session", Fault.hang(10), times=1)
    async with EnvironmentClient(config(server.url, seed_timeout_s=0.3)) as env:
        started = time.monotonic()
        with pytest.raises(EnvironmentFailure) as caught:
            async with open_session(env):
                pass
    assert caught.value.kind is FailureKind.SEED_FAILED
    assert "did not answer within 0.3s" in caught.value.reason
    assert time.monotonic() - started < 0.3 + 4.0  # a loaded machine's slack; the hang is 10 s


async def test_a_5xx_on_a_tool_call_is_a_server_error(server, client):
    server.inject("browser_observe", Fault.status(503))
    async with open_session(client) as session:
        with pytest.raises(EnvironmentFailure) as caught:
            await session.observe()
    assert caught.value.kind is FailureKind.SERVER_ERROR
    assert "503" in caught.value.reason
    assert server.open_sessions == 0


async def test_a_hung_tool_call_is_a_timeout_within_the_per_call_budget(server):
    server.inject("browser_click", Fault.hang(30))
    # Seconds, so that on a loaded machine the observe before the hung click cannot time out too.
    async with EnvironmentClient(config(server.url, call_timeout_s=3.0)) as env:
        async with open_session(env) as session:
            await session.observe()
            started = time.monotonic()
            with pytest.raises(EnvironmentFailure) as caught:
                await session.click(0)
            elapsed = time.monotonic() - started
    assert caught.value.kind is FailureKind.TIMEOUT
    assert 2.95 < elapsed < 3.0 + 4.0  # a loaded machine's slack; the hang is 30 s
    assert server.open_sessions == 0


async def test_a_session_the_server_forgot_is_session_lost(server, client):
    server.inject("browser_click", Fault.lose_session())
    async with open_session(client) as session:
        first = await session.observe()
        with pytest.raises(EnvironmentFailure) as caught:
            await session.click(element_id(first.observation, "About"))
    assert caught.value.kind is FailureKind.SESSION_LOST
    assert server.open_sessions == 0


async def test_a_browser_that_crashed_is_session_lost_not_a_page_error(server, client):
    server.inject("browser_observe", Fault.crash_browser(), on_call=2)
    async with open_session(client) as session:
        await session.observe()
        with pytest.raises(EnvironmentFailure) as caught:
            await session.observe()
    assert caught.value.kind is FailureKind.SESSION_LOST
    assert server.open_sessions == 0


async def test_a_connection_dropped_mid_response_on_a_click_is_not_retried(server, client):
    server.inject("browser_click", Fault.drop_connection())
    async with open_session(client) as session:
        first = await session.observe()
        with pytest.raises(EnvironmentFailure) as caught:
            await session.click(element_id(first.observation, "About"))
    assert caught.value.kind is FailureKind.UNREACHABLE
    assert "connection dropped" in caught.value.reason
    assert server.calls("browser_click") == 1


async def test_a_connection_dropped_on_an_idempotent_call_is_retried_within_budget(server, client):
    server.inject("browser_observe", Fault.drop_connection(None), times=2)
    async with open_session(client) as session:
        result = await session.observe()
    assert "TITLE: Home" in result.observation
    assert server.calls("browser_observe") == 3  # two drops, one answer: the budget of two retries


async def test_a_connection_dropped_more_often_than_the_budget_is_unreachable(server, client):
    server.inject("browser_observe", Fault.drop_connection(None))
    async with open_session(client) as session:
        with pytest.raises(EnvironmentFailure) as caught:
            await session.observe()
    assert caught.value.kind is FailureKind.UNREACHABLE
    assert server.calls("browser_observe") == 3


async def test_malformed_json_is_a_server_error(server, client):
    server.inject("browser_observe", Fault.malformed_json())
    async with open_session(client) as session:
        with pytest.raises(EnvironmentFailure) as caught:
            await session.observe()
    assert caught.value.kind is FailureKind.SERVER_ERROR
    assert "malformed JSON" in caught.value.reason


async def test_a_verify_that_could_not_grade_is_verify_unavailable_never_a_zero(server, client):
    async with open_session(client) as session:
        await session.observe()
        # No finish, so the server must read the live page, and the browser behind it has died.
        server.crash_browser(session.session_id)
        with pytest.raises(EnvironmentFailure) as caught:
            await session.verify()
    assert caught.value.kind is FailureKind.VERIFY_UNAVAILABLE
    assert "browser unreachable while scoring" in caught.value.reason
    assert server.open_sessions == 0


@pytest.mark.parametrize(
    "answer",
    [
        {"reward": 1.0, "mask_sample": True},
        # the judge-failure shape of Gym's reward-model servers: HTTP 200, a zero, a tag, and the mask
        {"reward": 0.0, "mask_sample": True, "judge_failed": True, "failure_tags": ["judge_failed"]},
    ],
    ids=["masked-one", "judge-failed-zero"],
)
async def test_a_verify_answer_masked_by_the_server_is_verify_unavailable_never_a_reward(server, client, answer):
    server.inject("verify", Fault.respond(answer))
    async with open_session(client) as session:
        await session.observe()
        with pytest.raises(EnvironmentFailure) as caught:
            await session.verify()
    assert caught.value.kind is FailureKind.VERIFY_UNAVAILABLE
    assert "mask_sample" in caught.value.reason


async def test_a_verify_answer_with_mask_sample_false_is_graded(server, client):
    server.inject("verify", Fault.respond({"reward": 0.0, "mask_sample": False}))
    async with open_session(client) as session:
        await session.observe()
        assert (await session.verify()).reward == 0.0


async def test_a_verify_of_a_lost_session_is_session_lost(server, client):
    async with open_session(client) as session:
        await session.observe()
        server.lose_session(session.session_id)
        with pytest.raises(EnvironmentFailure) as caught:
            await session.verify()
    assert caught.value.kind is FailureKind.SESSION_LOST
    assert "session not found" in caught.value.reason


async def test_verifying_twice_is_session_lost_because_verify_released_the_browser(server, client):
    async with open_session(client) as session:
        await session.observe()
        await session.finish("done")
        assert (await session.verify()).reward == 0.0  # still on the home page: a real, gradable zero
        with pytest.raises(EnvironmentFailure) as caught:
            await session.verify()
    assert caught.value.kind is FailureKind.SESSION_LOST


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (Fault.status(500), "HTTP 500"),
        (Fault.hang(10), "did not answer"),
        (Fault.malformed_json(), "malformed JSON"),
        (Fault.drop_connection(), "connection dropped"),
    ],
    ids=["5xx", "hang", "malformed", "dropped"],
)
async def test_every_verify_transport_failure_is_verify_unavailable(server, fault, expected):
    server.inject("verify", fault)
    # Only a hung verify may time out: the other faults answer at once and keep the default seconds.
    verify_timeout_s = 0.3 if fault.kind == "hang" else 2.0
    async with EnvironmentClient(config(server.url, verify_timeout_s=verify_timeout_s)) as env:
        async with open_session(env) as session:
            await session.observe()
            with pytest.raises(EnvironmentFailure) as caught:
                await session.verify()
    assert caught.value.kind is FailureKind.VERIFY_UNAVAILABLE
    assert expected in caught.value.reason
    assert server.calls("verify") == 1  # verify releases the browser, so it is never repeated


# ----- policy mistakes come back as values ---------------------------------------------------------------------


async def test_wrong_argument_names_come_back_to_the_model_as_an_error(server, client):
    async with open_session(client) as session:
        result = await session.call("browser_navigate", {"href": "about.html"})
    assert result.error is not None and result.error.startswith("invalid arguments for browser_navigate")
    assert "url" in result.error


async def test_a_non_integer_element_id_comes_back_as_an_error(server, client):
    async with open_session(client) as session:
        result = await session.call("browser_click", {"element_id": "the about link"})
    assert result.error is not None and "element_id" in result.error


async def test_an_element_id_not_on_the_page_comes_back_as_an_error(server, client):
    async with open_session(client) as session:
        await session.observe()
        result = await session.click(99)
    assert result.error is not None and "not in last observation" in result.error


async def test_a_click_before_any_observation_comes_back_as_an_error(server, client):
    async with open_session(client) as session:
        result = await session.click(0)
    assert result.error is not None and "call browser_observe first" in result.error


async def test_a_url_the_policy_chose_that_fails_to_load_comes_back_as_an_error(server, client):
    async with open_session(client) as session:
        await session.observe()
        result = await session.navigate("http://no-such-host.invalid/")
        still_there = await session.observe()
    assert result.error is not None and result.error.startswith("navigate failed")
    assert still_there.error is None


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        ({"url_equals": "x"}, "unknown verifier_metadata keys ['url_equals']"),
        ({"dom_contains": "x", "final_url": "y"}, "the server grades only one"),
        ({"url_contains": ""}, "must be a non-empty string"),
    ],
    ids=["unknown-key", "two-keys", "empty-value"],
)
async def test_metadata_the_server_would_misgrade_is_refused_before_any_request_and_holds_no_slot(
    server, client, verifier, message
):
    with pytest.raises(ValueError, match=re.escape(message)):
        async with open_session(client, verifier=verifier):
            pass
    assert server.calls() == 0
    assert client.outstanding == {server.url: 0}


def test_the_client_applies_the_one_row_rule_and_still_exports_it():
    assert validate_verifier_metadata is rows.validate_verifier_metadata
    assert VERIFIER_KEYS is rows.VERIFIER_KEYS


async def test_null_values_are_not_sent_to_the_server(server, client):
    async with open_session(client, verifier={"final_url": None, "url_contains": "index.html"}) as session:
        verdict = await session.verify()
    assert verdict.reward == 1.0  # the fake, like the real server, would grade final_url == None had the null gone out


async def test_verify_without_verifier_metadata_is_a_programming_error(server, client):
    async with open_session(client, verifier=None) as session:
        with pytest.raises(ValueError, match="judge"):
            await session.verify()
    assert "verify" not in server.events(session.session_id)


# ----- lifetimes -----------------------------------------------------------------------------------------------


async def test_close_is_idempotent_and_never_raises_when_the_server_is_gone(server, client, caplog):
    caplog.set_level(logging.WARNING)
    async with open_session(client) as session:
        await session.observe()
        await server.stop()
    await session.close()
    assert session.closed
    assert "close failed" in caplog.text


async def test_a_close_answered_with_a_5xx_is_retried_because_a_given_up_close_leaks_a_browser(server, client):
    server.inject("close_session", Fault.status(503), times=2)
    async with open_session(client) as session:
        await session.observe()
    assert server.calls("close_session") == 3
    assert server.open_sessions == 0
    assert await session.is_released()


async def test_a_close_that_times_out_is_tried_again_and_the_browser_released(server):
    # A busy server may take longer than one try to close a browser; giving up would leak it for good.
    server.inject("close_session", Fault.hang(), times=1)
    # Seconds, so that on a loaded machine the second try cannot time out as well.
    async with EnvironmentClient(config(server.url, close_timeout_s=2.0)) as client:
        async with open_session(client) as session:
            await session.observe()
    assert server.calls("close_session") == 2
    assert server.open_sessions == 0
    assert await session.is_released()


async def test_a_close_failing_beyond_its_budget_is_logged_not_raised(server, caplog):
    caplog.set_level(logging.WARNING)
    server.inject("close_session", Fault.status(503))
    async with EnvironmentClient(config(server.url, close_timeout_s=1.0)) as client:
        async with open_session(client) as session:
            await session.observe()
            started = time.monotonic()
    # Retried with backoff for 3 x close_timeout_s (3 s here) in all, then given up with a warning.
    assert 1.0 < time.monotonic() - started < 3.0 + 3.0  # a loaded machine's slack
    assert server.calls("close_session") > 3
    assert "close failed, the browser may stay open" in caplog.text
    assert server.open_sessions == 1  # what the warning says: the browser is still there


async def test_a_cancelled_episode_still_closes_its_session(server, client):
    server.inject("browser_click", Fault.hang(10))
    entered = asyncio.Event()
    holder = {}

    async def episode():
        async with open_session(client) as session:
            holder["session"] = session
            await session.observe()
            entered.set()
            await session.click(0)

    task = asyncio.create_task(episode())
    await entered.wait()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if server.open_sessions == 0:
            break
        await asyncio.sleep(0.02)
    assert server.open_sessions == 0
    assert server.events(holder["session"].session_id)[-1] == "close"


async def test_tool_calls_after_close_are_session_lost(server, client):
    async with open_session(client) as session:
        pass
    with pytest.raises(EnvironmentFailure) as caught:
        await session.observe()
    assert caught.value.kind is FailureKind.SESSION_LOST


# ----- several servers -----------------------------------------------------------------------------------------


async def test_sessions_spread_over_servers_by_least_outstanding():
    async with InProcessEnvironmentServer() as a, InProcessEnvironmentServer() as b:
        async with EnvironmentClient(config(a.url, b.url)) as env:
            async with (
                open_session(env, "r1") as s1,
                open_session(env, "r2") as s2,
                open_session(env, "r3") as s3,
                open_session(env, "r4") as s4,
            ):
                assert env.outstanding == {a.url: 2, b.url: 2}
                assert {s.server_url for s in (s1, s2, s3, s4)} == {a.url, b.url}
            assert env.outstanding == {a.url: 0, b.url: 0}
        assert a.open_sessions == b.open_sessions == 0


async def test_the_per_server_cap_makes_a_new_session_wait_for_a_free_slot(server):
    async with EnvironmentClient(config(server.url, max_sessions_per_server=1)) as env:
        order = []

        async def episode(name: str, hold_s: float):
            async with open_session(env, name):
                order.append(f"{name}+")
                await asyncio.sleep(hold_s)
                order.append(f"{name}-")

        await asyncio.gather(episode("r1", 0.1), episode("r2", 0.0))
    assert order == ["r1+", "r1-", "r2+", "r2-"]


async def test_a_server_that_stopped_answering_leaves_rotation_and_is_probed_back_in():
    async with InProcessEnvironmentServer() as a, InProcessEnvironmentServer() as b:
        # A cool-down of seconds, so that on a loaded machine it still runs while r2 and r3 open.
        async with EnvironmentClient(config(a.url, b.url, transient_retries=0, server_cooldown_s=3.0)) as env:
            await a.stop()
            with pytest.raises(EnvironmentFailure) as caught:
                async with open_session(env, "r1"):
                    pass
            assert caught.value.server_url == a.url
            # While a cools down, every new session goes to b, even with b busier.
            async with open_session(env, "r2") as s2, open_session(env, "r3") as s3:
                assert s2.server_url == s3.server_url == b.url
            await a.start()
            await asyncio.sleep(3.05)  # past the cool-down
            async with open_session(env, "r4") as s4, open_session(env, "r5") as s5:
                assert {s4.server_url, s5.server_url} == {a.url, b.url}


async def test_a_full_healthy_server_is_waited_for_rather_than_a_server_out_of_rotation():
    async with InProcessEnvironmentServer() as a, InProcessEnvironmentServer() as b:
        # a stays out of rotation for the whole test, however slowly a loaded machine runs it.
        settings = {"transient_retries": 0, "max_sessions_per_server": 1, "server_cooldown_s": 60.0}
        async with EnvironmentClient(config(a.url, b.url, **settings)) as env:
            await a.stop()
            with pytest.raises(EnvironmentFailure) as caught:
                async with open_session(env, "r0"):
                    pass
            assert caught.value.server_url == a.url  # the first session went to a and found it down
            order = []

            async def episode(name: str, hold_s: float):
                async with open_session(env, name) as session:
                    order.append((name, session.server_url))
                    await asyncio.sleep(hold_s)

            await asyncio.gather(episode("r1", 0.1), episode("r2", 0.0))
    # b holds one session at a time; r2 waits for it instead of going to a, which is out of rotation.
    assert order == [("r1", b.url), ("r2", b.url)]


async def test_a_released_slot_goes_to_the_first_waiter_and_a_cancelled_waiter_takes_none(server):
    async with EnvironmentClient(config(server.url, max_sessions_per_server=1)) as env:
        order = []
        holding, release = asyncio.Event(), asyncio.Event()

        async def first():
            async with open_session(env, "r1"):
                holding.set()
                await release.wait()

        async def waiter(name: str):
            async with open_session(env, name):
                order.append(name)

        tasks = [asyncio.create_task(first())]
        await holding.wait()
        for name in ("r2", "r3", "r4"):
            tasks.append(asyncio.create_task(waiter(name)))
            await asyncio.sleep(0.01)
        tasks[2].cancel()  # r3 gives up while it waits
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == ["r2", "r4"]
        assert env.outstanding == {server.url: 0}
    assert server.open_sessions == 0


def test_config_rejects_unknown_keys_and_splits_comma_separated_urls():
    built = EnvironmentConfig.from_mapping({"server_urls": "http://127.0.0.1:1/, http://127.0.0.1:2"})
    assert built.server_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    with pytest.raises(
        ValueError, match=r"environment\.call_timeout: unknown key; allowed here: server_urls, call_timeout_s"
    ):
        EnvironmentConfig.from_mapping({"server_urls": "http://x", "call_timeout": 3})
    with pytest.raises(ValueError, match="at least one"):
        EnvironmentConfig(server_urls=())
    with pytest.raises(ValueError, match=r"environment\.placement: Input should be 'auto', 'process' or 'ray'"):
        EnvironmentConfig.from_mapping({"server_urls": "http://x", "placement": "cluster"})
