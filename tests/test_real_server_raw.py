"""The real nemo-gym 0.7.0 interactive_browser server, spoken to in raw HTTP (plain aiohttp, no client of ours).

These tests pin down the wire facts the rest of the project (gym_contract/environment.py, gym_contract/rows.py, the
fake server) is built on:
the typed seed and its cookie, the observation format, verify's required body and its answers, which
``verifier_metadata`` key is graded when a row carries several or odd ones, the status codes of the failure paths,
the close answers, and that a closed or verified session leaves no browser open on the server side.
They run against ``http://127.0.0.1:PORT`` on purpose: an IP-address host is where aiohttp's default cookie jar
drops the session cookie.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from nemo_gym_browser.gym_contract.rows import RowValueError, validate_verifier_metadata
from nemo_gym_browser.launch_environment import BrowserState, LocalEnvironment
from nemo_gym_browser.local.local_site import LocalSite

pytestmark = pytest.mark.integration

COOKIE_NAME = "InteractiveBrowserResourcesServer___interactive_browser"
NO_SESSION = "no active session; seed_session must be called first"
LOST_AT_VERIFY = "browser session not found at verify"
# The smallest Responses API objects /verify accepts: it requires both fields and echoes them back.
RESPONSES_CREATE_PARAMS = {"input": []}
RESPONSE = {
    "id": "resp-raw",
    "created_at": 0,
    "model": "none",
    "object": "response",
    "output": [],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
}
VERIFY_BODY = {"responses_create_params": RESPONSES_CREATE_PARAMS, "response": RESPONSE}
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=60)
ELEMENT_LINE = re.compile(r"^\s*\[(\d+)\] (\w+): ?(.*)$")
_ids = itertools.count()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # unsafe=True: keep cookies from IP-address hosts such as 127.0.0.1.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=HTTP_TIMEOUT) as session:
        yield session


@pytest.fixture
async def env(real_environment: LocalEnvironment) -> AsyncIterator[LocalEnvironment]:
    """The shared environment, checked to hold no browser after each test (every test closes what it opens)."""
    yield real_environment
    state = await asyncio.to_thread(real_environment.wait_for_idle)
    assert state.idle, f"a browser was left open on the server: {state}"


def new_ids() -> tuple[str, dict]:
    n = next(_ids)
    return f"raw-{n}", {"rollout_id": f"raw-rollout-{n}", "attempt": 0}


def typed_seed(session_id: str, episode: dict, initial_url: str, verifier: dict | None) -> dict:
    return {
        "resources_session_id": session_id,
        "episode_id": episode,
        "task_id": {"taskset": "raw", "task_id": session_id},
        "task_data": {"initial_url": initial_url, "verifier_metadata": verifier},
    }


async def post(http: aiohttp.ClientSession, url: str, body: object | None = None) -> tuple[int, object]:
    async with http.post(url, json=body) as response:
        try:
            payload = await response.json(content_type=None)
        except ValueError:
            payload = await response.text()
        return response.status, payload


def element_id(observation: str, tag: str, name: str) -> int:
    for line in observation.splitlines():
        match = ELEMENT_LINE.match(line)
        if match and match.group(2) == tag and match.group(3).strip() == name:
            return int(match.group(1))
    raise AssertionError(f"no {tag} named {name!r} in:\n{observation}")


async def state_of(env: LocalEnvironment) -> BrowserState:
    return await asyncio.to_thread(env.browser_state)


@dataclass(frozen=True)
class Seeded:
    session_id: str
    episode: dict
    status: int
    body: object

    @property
    def close_body(self) -> dict:
        return {"resources_session_id": self.session_id, "episode_id": self.episode}


@contextlib.asynccontextmanager
async def seeded(
    http: aiohttp.ClientSession, env: LocalEnvironment, initial_url: str, verifier: dict | None = None
) -> AsyncIterator[Seeded]:
    """A typed seed whose session is closed on the way out, also when an assertion failed inside."""
    session_id, episode = new_ids()
    status, body = await post(http, f"{env.url}/seed_session", typed_seed(session_id, episode, initial_url, verifier))
    try:
        yield Seeded(session_id, episode, status, body)
    finally:
        await post(http, f"{env.url}/close_session", {"resources_session_id": session_id, "episode_id": episode})


# --------------------------------------------------------------------------------------------- a whole episode
async def test_a_typed_episode_on_our_site_scores_url_contains_1_and_its_close_leaves_no_browser(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    session_id, episode = new_ids()
    seed = typed_seed(session_id, episode, "about:blank", {"url_contains": "about.html"})
    close = {"resources_session_id": session_id, "episode_id": episode}
    try:
        status, body = await post(http, f"{env.url}/seed_session", seed)
        assert (status, body) == (
            200,
            {"resources_session_id": session_id, "resources_tools": None, "sandbox_access": None},
        )
        assert COOKIE_NAME in {cookie.key for cookie in http.cookie_jar}
        during = await state_of(env)
        assert not during.idle and during.drivers == 1, during

        status, body = await post(http, f"{env.url}/browser_observe", {})
        assert (status, body) == (
            200,
            {"observation": "URL: about:blank\nTITLE: \nELEMENTS:", "done": False, "error": None},
        )

        status, body = await post(http, f"{env.url}/browser_navigate", {"url": local_site.page("index.html")})
        assert status == 200 and body["error"] is None, body
        observation = body["observation"]
        assert observation.startswith(f"URL: {local_site.page('index.html')}\nTITLE: Test Site Home\nELEMENTS:\n")
        assert "\n  [0] a: About us\n" in observation
        assert "\nTEXT:\n  Welcome to the test site A small site of our own" in observation

        about = element_id(observation, "a", "About us")
        status, body = await post(http, f"{env.url}/browser_click", {"element_id": about})
        assert status == 200 and body["error"] is None, body
        assert body["observation"].startswith(f"URL: {local_site.page('about.html')}\nTITLE: About the Test Site\n")

        status, body = await post(http, f"{env.url}/browser_finish", {"answer": "done"})
        assert (status, body) == (200, {"observation": "", "done": True, "error": None})

        status, body = await post(http, f"{env.url}/verify", VERIFY_BODY)
        assert status == 200
        assert {k: body[k] for k in ("reward", "mask_sample", "failure_kind", "failure_reason")} == {
            "reward": 1.0,
            "mask_sample": False,
            "failure_kind": None,
            "failure_reason": None,
        }
        assert body["response"]["id"] == RESPONSE["id"]  # the request's objects come back
    finally:
        status, body = await post(http, f"{env.url}/close_session", close)
    assert (status, body) == (200, {"resources_session_id": session_id})
    after = await asyncio.to_thread(env.wait_for_idle)
    assert after.idle, after


@pytest.mark.parametrize(
    ("verifier", "expected"),
    [
        pytest.param({"final_url": "{site}/results.html?q=hello"}, 1.0, id="final_url-hit"),
        pytest.param({"final_url": "{site}/results.html"}, 0.0, id="final_url-miss"),
        pytest.param({"url_contains": "q=hello"}, 1.0, id="url_contains-hit"),
        pytest.param({"url_contains": "about.html"}, 0.0, id="url_contains-miss"),
        pytest.param({"dom_contains": "RESULTS FOR: HELLO"}, 1.0, id="dom_contains-hit-any-case"),
        pytest.param({"dom_contains": "Results for: goodbye"}, 0.0, id="dom_contains-miss"),
        pytest.param({"answer_equals": "hello"}, 1.0, id="answer_equals-hit-after-strip"),
        pytest.param({"answer_equals": "Hello"}, 0.0, id="answer_equals-miss-case-sensitive"),
    ],
)
async def test_every_verifier_key_scores_the_finished_search_episode(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite, verifier: dict, expected: float
):
    verifier = {key: value.format(site=local_site.url) for key, value in verifier.items()}
    async with seeded(http, env, local_site.page("index.html"), verifier) as seed:
        assert seed.status == 200
        _, body = await post(http, f"{env.url}/browser_observe", {})
        search_box = element_id(body["observation"], "input", "")
        search_button = element_id(body["observation"], "button", "Search")
        _, body = await post(http, f"{env.url}/browser_type", {"element_id": search_box, "text": "hello"})
        assert body["error"] is None and f"  [{search_box}] input: \n" in body["observation"]  # typed text not shown
        _, body = await post(http, f"{env.url}/browser_click", {"element_id": search_button})
        assert body["error"] is None and "Results for: hello" in body["observation"]
        _, body = await post(http, f"{env.url}/browser_finish", {"answer": "  hello \n"})
        assert body["done"] is True

        status, body = await post(http, f"{env.url}/verify", VERIFY_BODY)
        assert status == 200
        assert (body["reward"], body["failure_reason"], body["mask_sample"]) == (expected, None, False)


# --------------------------------------------------------------------------------------------- verifier_metadata
# Every case seeds the About page, finishes with the answer "done" and verifies; {about} is that page's URL. The last
# field is what rows.validate_verifier_metadata makes of the spec: REFUSED for every spec the server would grade on
# another key than the row's author meant, or on a value that measures nothing.
REFUSED = "refused"
ODD_SPECS = [
    pytest.param({"final_url": "{about}", "dom_contains": "Results for"}, 1.0, REFUSED, id="final_url-hit-dom-miss"),
    pytest.param({"dom_contains": "Results for", "final_url": "{about}"}, 1.0, REFUSED, id="dom-miss-final_url-hit"),
    pytest.param({"final_url": "{about}?x", "dom_contains": "founded in"}, 0.0, REFUSED, id="final_url-miss-dom-hit"),
    pytest.param({"dom_contains": "founded in", "final_url": "{about}?x"}, 0.0, REFUSED, id="dom-hit-final_url-miss"),
    pytest.param({"url_contains": "about.html", "answer_equals": "nope"}, 0.0, REFUSED, id="url-hit-answer-miss"),
    pytest.param({"dom_contains": "founded in", "url_contains": "index"}, 0.0, REFUSED, id="dom-hit-url-miss"),
    pytest.param({"url_contains": "about.html", "title_is": "nope"}, 1.0, REFUSED, id="unknown-key-beside-a-known"),
    pytest.param({"dom_contains": ""}, 1.0, REFUSED, id="empty-dom_contains-matches-any-page"),
    pytest.param({"url_contains": ""}, 1.0, REFUSED, id="empty-url_contains-matches-any-url"),
    # The server counts a null as a key; the rule drops it, so what it returns (not the row) must be sent.
    pytest.param(
        {"final_url": None, "url_contains": "about.html"}, 0.0, {"url_contains": "about.html"}, id="null-is-a-key"
    ),
    pytest.param({"url_contains": "about.html"}, 1.0, {"url_contains": "about.html"}, id="one-key"),
]


@pytest.mark.parametrize(("verifier", "expected", "rule"), ODD_SPECS)
async def test_the_server_grades_only_the_first_known_key_present_whatever_else_the_spec_holds(
    env: LocalEnvironment,
    http: aiohttp.ClientSession,
    local_site: LocalSite,
    verifier: dict,
    expected: float,
    rule: dict | str,
):
    about = local_site.page("about.html")
    verifier = {key: value.format(about=about) if isinstance(value, str) else value for key, value in verifier.items()}
    async with seeded(http, env, about, verifier) as seed:
        assert seed.status == 200
        _, body = await post(http, f"{env.url}/browser_finish", {"answer": "done"})
        assert body["done"] is True
        status, body = await post(http, f"{env.url}/verify", VERIFY_BODY)
    assert status == 200
    assert (body["reward"], body["failure_reason"]) == (expected, None)
    if rule == REFUSED:
        with pytest.raises(RowValueError):
            validate_verifier_metadata(verifier)
    else:
        assert validate_verifier_metadata(verifier) == rule


async def test_a_number_in_url_contains_is_reported_as_an_unreachable_browser_not_graded(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    async with seeded(http, env, local_site.page("about.html"), {"url_contains": 1999}) as seed:
        assert seed.status == 200
        status, body = await post(http, f"{env.url}/verify", VERIFY_BODY)
    assert status == 200 and body["reward"] == 0.0
    assert body["failure_reason"].startswith("browser unreachable while scoring: TypeError: ")
    with pytest.raises(RowValueError, match="must be a non-empty string, got 1999"):
        validate_verifier_metadata({"url_contains": 1999})


@pytest.mark.parametrize("verifier", [None, {}], ids=["none", "empty"])
async def test_a_seed_without_a_spec_answers_500_at_verify(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite, verifier: dict | None
):
    async with seeded(http, env, local_site.page("about.html"), verifier) as seed:
        assert seed.status == 200
        status, body = await post(http, f"{env.url}/verify", VERIFY_BODY)
    assert status == 500
    assert "verifier_metadata has no supported scoring key (got [];" in body
    assert validate_verifier_metadata(verifier) is None  # no spec: the judge grades the task, /verify is not called


# --------------------------------------------------------------------------------------------- failure paths
async def test_verify_without_the_responses_fields_answers_422_naming_both(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    async with seeded(http, env, local_site.page("index.html")) as seed:
        assert seed.status == 200
        status, body = await post(http, f"{env.url}/verify", {})
        assert status == 422
        assert body == {
            "detail": [
                {"type": "missing", "loc": ["body", "responses_create_params"], "msg": "Field required", "input": {}},
                {"type": "missing", "loc": ["body", "response"], "msg": "Field required", "input": {}},
            ]
        }
        # A 422 never reached the handler: the browser is still held until the close.
        assert not (await state_of(env)).idle


async def test_an_unknown_verifier_key_answers_500_and_still_releases_the_browser(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    async with seeded(http, env, local_site.page("about.html"), {"title_is": "About the Test Site"}) as seed:
        assert seed.status == 200
        assert not (await state_of(env)).idle
        status, body = await post(http, f"{env.url}/verify", VERIFY_BODY)
        assert status == 500
        assert body == (
            "ValueError(\"verifier_metadata has no supported scoring key (got ['title_is']; "
            "expected one of ['final_url', 'url_contains', 'dom_contains', 'answer_equals'])\")"
        )
        assert (await asyncio.to_thread(env.wait_for_idle)).idle  # verify released it before raising


async def test_verifying_twice_reports_a_lost_session_as_a_failure_reason_not_a_mask(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    async with seeded(http, env, local_site.page("index.html"), {"url_contains": "index.html"}):
        first = (await post(http, f"{env.url}/verify", VERIFY_BODY))[1]
        status, second = await post(http, f"{env.url}/verify", VERIFY_BODY)
        tool_after_verify = await post(http, f"{env.url}/browser_observe", {})
    assert (first["reward"], first["failure_reason"]) == (1.0, None)  # graded the live page: no finish needed
    assert status == 200
    assert (second["reward"], second["failure_reason"], second["failure_kind"], second["mask_sample"]) == (
        0.0,
        LOST_AT_VERIFY,
        None,
        False,
    )
    assert tool_after_verify == (200, {"observation": "", "done": False, "error": NO_SESSION})


async def test_the_default_cookie_jar_drops_the_session_cookie_of_an_ip_host(
    env: LocalEnvironment, local_site: LocalSite
):
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as default_jar:
        async with seeded(default_jar, env, local_site.page("index.html")) as seed:
            assert seed.status == 200
            assert len(default_jar.cookie_jar) == 0
            observed = await post(default_jar, f"{env.url}/browser_observe", {})
            # The seeded browser is still held: only the typed close (no cookie needed) releases it.
            held = await state_of(env)
    assert observed == (200, {"observation": "", "done": False, "error": NO_SESSION})
    assert not held.idle


async def test_policy_errors_come_back_as_values_and_wrong_argument_names_as_422(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    async with seeded(http, env, local_site.page("index.html")):
        unobserved_click = await post(http, f"{env.url}/browser_click", {"element_id": 0})
        wrong_name = await post(http, f"{env.url}/browser_click", {"id": 0})
        dead_port = await post(http, f"{env.url}/browser_navigate", {"url": "http://127.0.0.1:9/"})
    assert unobserved_click == (
        200,
        {
            "observation": "",
            "done": False,
            "error": "click failed: 'element_id 0 not in last observation; call browser_observe first'",
        },
    )
    assert wrong_name == (
        422,
        {"detail": [{"type": "missing", "loc": ["body", "element_id"], "msg": "Field required", "input": {"id": 0}}]},
    )
    status, body = dead_port
    assert status == 200 and body["observation"] == "" and body["done"] is False
    assert body["error"].startswith("navigate failed: Page.goto: net::ERR_UNSAFE_PORT at http://127.0.0.1:9/")


async def test_a_closed_session_id_cannot_be_seeded_again_and_closing_twice_is_fine(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    session_id, episode = new_ids()
    seed = typed_seed(session_id, episode, local_site.page("index.html"), None)
    close = {"resources_session_id": session_id, "episode_id": episode}
    assert (await post(http, f"{env.url}/seed_session", seed))[0] == 200
    assert await post(http, f"{env.url}/close_session", close) == (200, {"resources_session_id": session_id})
    assert await post(http, f"{env.url}/close_session", close) == (200, {"resources_session_id": session_id})
    assert await post(http, f"{env.url}/seed_session", seed) == (
        500,
        f"ValueError('resources session is already closed: {session_id}')",
    )
    other_episode = {**close, "episode_id": {"rollout_id": "someone-else", "attempt": 0}}
    assert await post(http, f"{env.url}/close_session", other_episode) == (
        500,
        "ValueError('episode_id does not match the closed resources session')",
    )


async def test_a_legacy_seed_answers_an_empty_object_and_an_empty_close_releases_by_cookie(
    env: LocalEnvironment, http: aiohttp.ClientSession, local_site: LocalSite
):
    try:
        seeded_answer = await post(
            http, f"{env.url}/seed_session", {"initial_url": local_site.page("about.html"), "verifier_metadata": None}
        )
        _, observed = await post(http, f"{env.url}/browser_observe", {})
        held = await state_of(env)
    finally:
        closed = await post(http, f"{env.url}/close_session")
    assert seeded_answer == (200, {})
    assert observed["observation"].startswith(f"URL: {local_site.page('about.html')}\nTITLE: About the Test Site\n")
    assert not held.idle
    assert closed == (200, {"closed": True})
