"""What the server says decides, not what the policy wrote; every byte the server sends maps to a failure kind.

Through the fake server, which echoes the policy's arguments where the real one does (the URL of a failed
navigation, the text of a failed fill in Playwright's call log, the input of a 422).
"""

from __future__ import annotations

import math

import pytest
from environment_fixtures import config

from nemo_gym_browser.gym_contract.environment import EnvironmentClient, VerifyResult
from nemo_gym_browser.gym_contract.failures import EnvironmentFailure, FailureKind
from nemo_gym_browser.gym_contract.server_answers import BROWSER_GONE_OPENINGS, NO_SESSION_ERROR
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.settings import EnvironmentConfig

START = "site/index.html"
ABOUT = {"url_contains": "about.html"}
# Every phrase the classifier knows, as the policy could write it, plus the server's own messages whole.
MARKERS = (
    *BROWSER_GONE_OPENINGS,
    "Target page, context or browser has been closed",
    "backend is not open; call open() first",
    "Browser closed.",
    "Connection closed",
    NO_SESSION_ERROR,
)
CAP = 16 * 1024


@pytest.fixture
async def capped(server):
    async with EnvironmentClient(config(server.url, max_answer_bytes=CAP)) as env:
        yield env


def open_session(client: EnvironmentClient, verifier=ABOUT):
    return client.session(rollout_id="r1", attempt=0, task_id="t1", initial_url=START, verifier_metadata=verifier)


def element_id(observation: str, name: str) -> int:
    for line in observation.splitlines():
        if line.strip().startswith("[") and line.strip().endswith(name):
            return int(line.strip()[1 : line.strip().index("]")])
    raise AssertionError(f"no element {name!r} in {observation!r}")


# ----- item: the policy's text never classifies ---------------------------------------------------------------


@pytest.mark.parametrize("marker", MARKERS)
@pytest.mark.parametrize(
    "url",
    ["http://shop.invalid/?q={}", "http://shop.invalid/{}", "http://shop.invalid/#{}", "{}"],
    ids=["query", "path", "fragment", "bare"],
)
async def test_a_navigation_whose_url_carries_a_browser_gone_phrase_is_the_policys_error(server, client, url, marker):
    async with open_session(client) as session:
        result = await session.navigate(url.format(marker))
        assert result.error is not None and result.error.startswith("navigate failed: Page.goto: ")
        # The server echoed the policy's URL (spaces encoded unless the URL is invalid), not taken for the browser's.
        assert marker.replace(" ", "%20") in result.error or marker in result.error
        assert (await session.observe()).error is None  # the session goes on
    assert server.open_sessions == 0


@pytest.mark.parametrize("marker", MARKERS)
async def test_text_typed_into_a_field_that_refuses_it_is_the_policys_error_whatever_it_says(server, client, marker):
    async with open_session(client) as session:
        first = await session.observe()
        result = await session.type(element_id(first.observation, "About"), marker)  # a link: fill fails
        assert result.error is not None and result.error.startswith("type failed: ElementHandle.fill: ")
        assert f'fill("{marker}")' in result.error
        assert (await session.observe()).error is None


@pytest.mark.parametrize("marker", MARKERS)
async def test_an_element_id_carrying_a_browser_gone_phrase_is_the_policys_error(server, client, marker):
    async with open_session(client) as session:
        await session.observe()
        result = await session.call("browser_click", {"element_id": marker})
        assert result.error is not None and "element_id" in result.error
        assert (await session.observe()).error is None


@pytest.mark.parametrize("marker", MARKERS)
async def test_a_final_answer_carrying_a_browser_gone_phrase_is_graded_as_an_answer(server, client, marker):
    async with open_session(client) as session:
        await session.observe()
        finished = await session.finish(marker)
        assert finished.done and finished.error is None
        assert (await session.verify()).reward == 0.0  # still on the start page


PHRASE = "Target page, context or browser has been closed"


@pytest.mark.parametrize(
    "tool, arguments",
    [
        ("browser_navigate", {"url": f"http://shop.invalid/?q={PHRASE}"}),
        ("browser_type", {"element_id": 0, "text": f"it says: {PHRASE}"}),
    ],
)
async def test_a_crashed_browser_is_session_lost_even_when_the_policys_argument_says_the_same(
    server, client, tool, arguments
):
    async with open_session(client) as session:
        await session.observe()
        server.crash_browser(session.session_id)
        with pytest.raises(EnvironmentFailure) as caught:
            await session.call(tool, arguments)
    assert caught.value.kind is FailureKind.SESSION_LOST
    assert PHRASE in caught.value.reason


async def test_a_session_the_server_forgot_is_session_lost_whatever_the_policy_navigated_to(server, client):
    async with open_session(client) as session:
        server.lose_session(session.session_id)
        with pytest.raises(EnvironmentFailure) as caught:
            await session.navigate("http://shop.invalid/")
    assert caught.value.kind is FailureKind.SESSION_LOST


# ----- item: every byte from the server maps to a failure ------------------------------------------------------

MALFORMED = [
    pytest.param(Fault.invalid_utf8(), "not UTF-8", id="invalid-utf8"),
    pytest.param(Fault.deep_json(5000), "nested deeper", id="deep-json-past-the-parser"),
    pytest.param(Fault.deep_json(200), "nested deeper", id="deep-json-past-the-cap"),
    pytest.param(Fault.oversized(CAP * 16), "max_answer_bytes", id="oversized"),
    pytest.param(Fault.oversized(CAP * 16, chunked=True), "max_answer_bytes", id="oversized-chunked"),
    pytest.param(Fault.malformed_json(b'{"observation": ' + b"1" * 5000 + b"}"), "malformed JSON", id="huge-integer"),
]


@pytest.mark.parametrize("fault, said", MALFORMED)
async def test_a_malformed_tool_answer_is_a_server_error(server, capped, fault, said):
    server.inject("browser_observe", fault)
    async with open_session(capped) as session:
        with pytest.raises(EnvironmentFailure) as caught:
            await session.observe()
    assert caught.value.kind is FailureKind.SERVER_ERROR
    assert said in caught.value.reason
    assert server.open_sessions == 0


@pytest.mark.parametrize("fault, said", MALFORMED)
async def test_a_malformed_seed_answer_is_seed_failed(server, capped, fault, said):
    server.inject("seed_session", fault)
    with pytest.raises(EnvironmentFailure) as caught:
        async with open_session(capped):
            pass
    assert caught.value.kind is FailureKind.SEED_FAILED
    assert said in caught.value.reason


@pytest.mark.parametrize("fault, said", MALFORMED)
async def test_a_malformed_verify_answer_is_verify_unavailable(server, capped, fault, said):
    server.inject("verify", fault)
    async with open_session(capped) as session:
        await session.observe()
        with pytest.raises(EnvironmentFailure) as caught:
            await session.verify()
    assert caught.value.kind is FailureKind.VERIFY_UNAVAILABLE
    assert said in caught.value.reason


async def test_a_malformed_5xx_body_is_still_the_calls_failure(server, capped):
    server.inject("browser_observe", Fault.invalid_utf8(status=503))
    async with open_session(capped) as session:
        with pytest.raises(EnvironmentFailure) as caught:
            await session.observe()
    assert caught.value.kind is FailureKind.SERVER_ERROR
    assert "503" in caught.value.reason


@pytest.mark.parametrize("detail", [[{"loc": 5, "msg": "bad"}], [{"loc": None}], "text", [[1]]])
async def test_a_422_with_an_odd_detail_still_comes_back_to_the_model(server, client, detail):
    server.inject("browser_click", Fault.status(422, {"detail": detail}))
    async with open_session(client) as session:
        await session.observe()
        result = await session.click(0)
    assert result.error is not None and result.error.startswith("invalid arguments for browser_click")


async def test_an_answer_of_exactly_max_answer_bytes_is_read(server, capped):
    server.inject("browser_observe", Fault.oversized(CAP, chunked=True))
    async with open_session(capped) as session:
        result = await session.observe()
    assert result.error is None and len(result.observation) > CAP // 2


def test_max_answer_bytes_is_generous_by_default_and_has_a_floor():
    assert EnvironmentConfig(server_urls=("http://x",)).max_answer_bytes >= 16 * 1024 * 1024
    with pytest.raises(ValueError):
        EnvironmentConfig(server_urls=("http://x",), max_answer_bytes=10)


# ----- item: a reward is a finite number in [0, 1] ------------------------------------------------------------


@pytest.mark.parametrize(
    "reward", [math.nan, math.inf, -math.inf, -0.5, 1.5, 1e308], ids=["nan", "inf", "-inf", "negative", "1.5", "huge"]
)
async def test_a_reward_outside_zero_to_one_is_verify_unavailable_never_a_reward(server, client, reward):
    server.inject("verify", Fault.regrade(reward))
    async with open_session(client) as session:
        await session.observe()
        with pytest.raises(EnvironmentFailure) as caught:
            await session.verify()
    assert caught.value.kind is FailureKind.VERIFY_UNAVAILABLE
    assert "reward" in caught.value.reason
    assert server.open_sessions == 0


@pytest.mark.parametrize("reward", ["0.5", True, None, [1.0]], ids=["string", "bool", "null", "list"])
async def test_a_reward_that_is_not_a_number_is_verify_unavailable(server, client, reward):
    server.inject("verify", Fault.respond({"reward": reward, "mask_sample": False}))
    async with open_session(client) as session:
        await session.observe()
        with pytest.raises(EnvironmentFailure) as caught:
            await session.verify()
    assert caught.value.kind is FailureKind.VERIFY_UNAVAILABLE


@pytest.mark.parametrize("reward", [0.0, 0.25, 1.0, 1])
async def test_a_reward_in_range_is_returned_as_is(server, client, reward):
    server.inject("verify", Fault.regrade(reward))
    async with open_session(client) as session:
        await session.observe()
        assert (await session.verify()).reward == reward


@pytest.mark.parametrize("reward", [math.nan, -0.1, 2.0])
def test_no_verify_result_can_hold_a_reward_outside_zero_to_one(reward):
    with pytest.raises(ValueError):
        VerifyResult(reward=reward)
