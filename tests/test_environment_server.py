"""The fake ``interactive_browser`` server keeps the NeMo Gym 0.7.0 wire contract and injects every fault it offers.

Driven with plain aiohttp (``CookieJar(unsafe=True)``, as a client of an IP-address host must), so these tests say
nothing about our own client: they pin what the fake answers. The texts and shapes asserted here were compared
byte for byte against the real server driving Debian's Chromium.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.environment_server.sessions import NO_SESSION_ERROR, SESSION_NOT_FOUND_AT_VERIFY
from nemo_gym_browser.local.environment_server.site_model import (
    BUNDLED_INITIAL_URL,
    BUNDLED_ROOT,
    BUNDLED_VERIFIER_METADATA,
    Element,
    Page,
    Site,
    button,
    link,
    text_input,
)
from nemo_gym_browser.local.environment_server.wire import COOKIE_NAME
from nemo_gym_browser.local.faults.kinds import Fault, SeenRequest

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=10)
INDEX_URL = BUNDLED_ROOT + "site/index.html"
ABOUT_URL = BUNDLED_ROOT + "site/about.html"
FORM_URL = BUNDLED_ROOT + "site/form.html"
EPISODE = {"rollout_id": "rollout-1", "attempt": 0}
TASK = {"taskset": "browser", "task_id": "task-1"}
# The smallest body /verify accepts: NeMo Gym's Responses API request and response objects.
VERIFY_BODY = {
    "responses_create_params": {"input": "hi"},
    "response": {
        "id": "r",
        "created_at": 0,
        "model": "m",
        "object": "response",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    },
}
INDEX_OBSERVATION = (
    f"URL: {INDEX_URL}\nTITLE: Home\nELEMENTS:\n  [0] a: Go to form\n  [1] a: About\n"
    "TEXT:\n  Lexmount Test Home Go to form About"
)
ABOUT_OBSERVATION = f"URL: {ABOUT_URL}\nTITLE: About\nELEMENTS:\nTEXT:\n  About Lexmount Secret code: ALPHA-42"


def typed_seed(session_id: str, task_data: dict[str, Any] | None = None, episode: dict | None = None) -> dict:
    if task_data is None:
        task_data = {"initial_url": BUNDLED_INITIAL_URL, "verifier_metadata": dict(BUNDLED_VERIFIER_METADATA)}
    return {
        "resources_session_id": session_id,
        "episode_id": episode or EPISODE,
        "task_id": TASK,
        "task_data": task_data,
    }


def typed_close(session_id: str, episode: dict | None = None) -> dict:
    return {"resources_session_id": session_id, "episode_id": episode or EPISODE}


class Client:
    """One rollout's HTTP side: its own cookie jar that keeps cookies of 127.0.0.1."""

    def __init__(self, server: InProcessEnvironmentServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session

    async def post(self, endpoint: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        if body is not None:
            kwargs["json"] = body
        async with self.session.post(f"{self.server.url}/{endpoint}", **kwargs) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except json.JSONDecodeError:
                return response.status, text

    async def tool(self, endpoint: str, body: Any = None) -> dict:
        status, answer = await self.post(endpoint, {} if body is None else body)
        assert status == 200, answer
        return answer


@pytest.fixture
async def server() -> AsyncIterator[InProcessEnvironmentServer]:
    async with InProcessEnvironmentServer() as fake:
        yield fake


@pytest.fixture
async def client(server: InProcessEnvironmentServer) -> AsyncIterator[Client]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=CLIENT_TIMEOUT) as session:
        yield Client(server, session)


async def seeded(client: Client, session_id: str = "s-1", task_data: dict | None = None) -> None:
    status, answer = await client.post("seed_session", typed_seed(session_id, task_data))
    assert (status, answer["resources_session_id"]) == (200, session_id)


# ------------------------------------------------------------------------------------------------------------------
# Sessions and the bundled example episode
# ------------------------------------------------------------------------------------------------------------------


async def test_the_bundled_example_episode_reaches_the_about_page_and_verifies_to_one(server, client) -> None:
    status, answer = await client.post("seed_session", typed_seed("s-1"))
    assert (status, answer) == (200, {"resources_session_id": "s-1", "resources_tools": None, "sandbox_access": None})

    assert (await client.tool("browser_observe"))["observation"] == INDEX_OBSERVATION
    assert await client.tool("browser_click", {"element_id": 1}) == {
        "observation": ABOUT_OBSERVATION,
        "done": False,
        "error": None,
    }
    assert await client.tool("browser_finish", {"answer": ""}) == {"observation": "", "done": True, "error": None}
    status, verdict = await client.post("verify", VERIFY_BODY)
    assert status == 200
    assert (verdict["reward"], verdict["mask_sample"], verdict["failure_kind"], verdict["failure_reason"]) == (
        1.0,
        False,
        None,
        None,
    )
    assert list(verdict)[-4:] == ["reward", "mask_sample", "failure_kind", "failure_reason"]
    assert await client.post("close_session", typed_close("s-1")) == (200, {"resources_session_id": "s-1"})

    assert server.events("s-1") == ["seed", "observe", "click", "finish", "verify", "close"]
    assert server.open_sessions == 0


async def test_the_seed_sets_the_session_cookie_and_every_later_answer_resends_it(server) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=CLIENT_TIMEOUT) as session:
        async with session.post(f"{server.url}/seed_session", json=typed_seed("s-1")) as response:
            seed_cookie = response.cookies[COOKIE_NAME]
        async with session.post(f"{server.url}/browser_observe", json={}) as response:
            observe_cookie = response.cookies[COOKIE_NAME]
    assert seed_cookie.value == observe_cookie.value
    assert (seed_cookie["path"], seed_cookie["max-age"], seed_cookie["httponly"]) == ("/", "1209600", True)


async def test_a_default_cookie_jar_drops_the_ip_host_cookie_and_every_call_lands_in_a_fresh_session(server) -> None:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:  # the default jar: no cookies for IPs
        naive = Client(server, session)
        await seeded(naive)
        answer = await naive.tool("browser_observe")
    assert answer == {"observation": "", "done": False, "error": NO_SESSION_ERROR}
    assert server.open_sessions == 1  # the seeded browser is still there, unreachable


async def test_passing_the_cookie_explicitly_reaches_the_seeded_browser(server) -> None:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        async with session.post(f"{server.url}/seed_session", json=typed_seed("s-1")) as response:
            cookie = response.cookies[COOKIE_NAME].value
        headers = {"Cookie": f"{COOKIE_NAME}={cookie}"}
        async with session.post(f"{server.url}/browser_observe", json={}, headers=headers) as response:
            answer = await response.json()
    assert answer["observation"] == INDEX_OBSERVATION


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("browser_observe", {}),
        ("browser_navigate", {"url": INDEX_URL}),
        ("browser_click", {"element_id": 0}),
        ("browser_type", {"element_id": 0, "text": "x"}),
        ("browser_finish", {"answer": "x"}),
    ],
)
async def test_every_tool_without_a_session_answers_no_active_session(client, endpoint, body) -> None:
    assert await client.tool(endpoint, body) == {"observation": "", "done": False, "error": NO_SESSION_ERROR}


async def test_a_repeated_typed_seed_for_the_same_episode_opens_no_second_browser(server, client) -> None:
    await seeded(client)
    await seeded(client)
    assert server.open_sessions == 1

    status, answer = await client.post("seed_session", typed_seed("s-1", episode={"rollout_id": "other"}))
    assert (status, answer) == (500, "ValueError('resources_session_id is already bound to another episode or task')")


async def test_a_legacy_seed_answers_an_empty_object_and_an_empty_close_releases_it(server, client) -> None:
    assert await client.post("seed_session", {"initial_url": "site/form.html"}) == (200, {})
    assert (await client.tool("browser_observe"))["observation"].startswith(f"URL: {FORM_URL}\nTITLE: Form")
    assert server.open_sessions == 1

    assert await client.post("close_session") == (200, {"closed": True})
    assert server.open_sessions == 0


async def test_a_typed_body_missing_task_data_is_taken_for_a_legacy_seed(server, client) -> None:
    body = typed_seed("s-1")
    del body["task_data"]
    assert await client.post("seed_session", body) == (200, {})
    assert (await client.tool("browser_observe"))["observation"] == "URL: about:blank\nTITLE: \nELEMENTS:"
    assert "s-1" not in server.open_session_ids


async def test_a_relative_initial_url_resolves_to_a_file_url_under_the_server_folder(client) -> None:
    await seeded(client, task_data={"initial_url": "site/about.html"})
    assert (await client.tool("browser_observe"))["observation"] == ABOUT_OBSERVATION


async def test_a_start_page_that_fails_to_load_answers_500_and_leaves_nothing_open(server, client) -> None:
    status, answer = await client.post("seed_session", typed_seed("s-1", {"initial_url": "site/missing.html"}))
    missing = BUNDLED_ROOT + "site/missing.html"
    assert status == 500
    # nemo_gym answers repr(exception) as a JSON string; this one is Playwright's Error.
    assert answer == (
        f"Error('Page.goto: net::ERR_FILE_NOT_FOUND at {missing}\\nCall log:\\n"
        f'  - navigating to "{missing}", waiting until "domcontentloaded"\\n\')'
    )
    assert server.open_sessions == 0
    await seeded(client, "s-1")  # the id was never bound: a retry may use it


async def test_close_releases_the_browser_and_a_reseed_of_the_closed_id_answers_500(server, client) -> None:
    await seeded(client)
    async with client.session.post(f"{server.url}/close_session", json=typed_close("s-1")) as response:
        assert response.status == 200
        assert "1970" in response.headers["Set-Cookie"]  # the cookie session is cleared
    assert server.open_sessions == 0
    assert (await client.tool("browser_observe"))["error"] == NO_SESSION_ERROR

    assert await client.post("seed_session", typed_seed("s-1")) == (
        500,
        "ValueError('resources session is already closed: s-1')",
    )
    assert server.open_sessions == 0


async def test_closing_twice_succeeds_and_a_close_for_another_episode_answers_500(client) -> None:
    await seeded(client)
    assert await client.post("close_session", typed_close("s-1")) == (200, {"resources_session_id": "s-1"})
    assert await client.post("close_session", typed_close("s-1")) == (200, {"resources_session_id": "s-1"})
    assert await client.post("close_session", typed_close("s-1", {"rollout_id": "other"})) == (
        500,
        "ValueError('episode_id does not match the closed resources session')",
    )


async def test_closing_an_id_that_was_never_seeded_blocks_a_late_seed(server, client) -> None:
    assert await client.post("close_session", typed_close("late")) == (200, {"resources_session_id": "late"})
    status, _ = await client.post("seed_session", typed_seed("late"))
    assert status == 500
    assert server.open_sessions == 0


async def test_a_malformed_close_body_answers_422_without_the_body_prefix(client) -> None:
    status, answer = await client.post("close_session", {"resources_session_id": "s-1"})
    (error,) = answer["detail"]
    # The real handler raises the pydantic errors itself, so they keep pydantic's documentation link.
    url = error.pop("url")
    assert (status, error) == (
        422,
        {"type": "missing", "loc": ["episode_id"], "msg": "Field required", "input": {"resources_session_id": "s-1"}},
    )
    assert url.startswith("https://errors.pydantic.dev/") and url.endswith("/v/missing")


async def test_liveness_paths_answer_ok_and_unknown_paths_404(server, client) -> None:
    async with client.session.get(f"{server.url}/health") as response:
        assert (response.status, await response.json()) == (200, {"status": "ok"})
    assert await client.post("nope", {}) == (404, {"detail": "Not Found"})


# ------------------------------------------------------------------------------------------------------------------
# Tools: arguments, element ids, navigation, typing, finish
# ------------------------------------------------------------------------------------------------------------------


async def test_wrong_argument_names_answer_fastapis_422(client) -> None:
    await seeded(client)
    assert await client.post("browser_click", {"id": 1}) == (
        422,
        {"detail": [{"type": "missing", "loc": ["body", "element_id"], "msg": "Field required", "input": {"id": 1}}]},
    )
    status, answer = await client.post("browser_click", {"element_id": "abc"})
    assert (status, answer["detail"][0]["type"]) == (422, "int_parsing")
    assert await client.post("browser_finish") == (
        422,
        {"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]},
    )


async def test_a_request_body_that_is_not_json_answers_422_json_invalid(client) -> None:
    status, answer = await client.post(
        "browser_click", data=b'{"element_id": ', headers={"Content-Type": "application/json"}
    )
    assert (status, answer) == (
        422,
        {
            "detail": [
                {
                    "type": "json_invalid",
                    "loc": ["body", 15],
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": "Expecting value"},
                }
            ]
        },
    )


async def test_element_ids_are_bound_by_the_latest_observation(client) -> None:
    await seeded(client)
    not_bound = "click failed: 'element_id 0 not in last observation; call browser_observe first'"
    assert (await client.tool("browser_click", {"element_id": 0}))["error"] == not_bound

    await client.tool("browser_observe")
    await client.tool("browser_click", {"element_id": 1})  # to the About page, which has no elements
    answer = await client.tool("browser_click", {"element_id": 1})
    assert answer["error"] == "click failed: 'element_id 1 not in last observation; call browser_observe first'"


async def test_a_failed_navigation_is_a_page_error_and_leaves_the_old_ids_detached(client) -> None:
    await seeded(client)
    await client.tool("browser_observe")

    answer = await client.tool("browser_navigate", {"url": "http://shop.invalid"})
    assert answer == {
        "observation": "",
        "done": False,
        "error": "navigate failed: Page.goto: net::ERR_NAME_NOT_RESOLVED at http://shop.invalid/\nCall log:\n"
        '  - navigating to "http://shop.invalid/", waiting until "domcontentloaded"\n',
    }
    stale = await client.tool("browser_click", {"element_id": 0})
    assert stale["error"] == (
        "click failed: ElementHandle.click: Element is not attached to the DOM\nCall log:\n"
        "  - attempting click action\n    - waiting for element to be visible, enabled and stable\n"
    )
    error_page = (await client.tool("browser_observe"))["observation"]
    assert error_page.startswith("URL: chrome-error://chromewebdata/\nTITLE: shop.invalid\nELEMENTS:\n")
    assert "ERR_NAME_NOT_RESOLVED" in error_page


async def test_a_loopback_url_nobody_serves_is_refused_and_an_invalid_url_keeps_the_page(client) -> None:
    await seeded(client)
    refused = await client.tool("browser_navigate", {"url": "http://127.0.0.1:45678/x"})
    assert refused["error"].startswith("navigate failed: Page.goto: net::ERR_CONNECTION_REFUSED at http://127.0.0.1")

    await client.tool("browser_navigate", {"url": INDEX_URL})
    invalid = await client.tool("browser_navigate", {"url": "example.com"})
    assert invalid["error"].startswith(
        "navigate failed: Page.goto: Protocol error (Page.navigate): Cannot navigate to invalid URL\n"
    )
    assert (await client.tool("browser_observe"))["observation"] == INDEX_OBSERVATION


async def test_a_port_chromium_refuses_is_an_unsafe_port_error_and_about_urls_are_blank_pages(client) -> None:
    await seeded(client)
    unsafe = await client.tool("browser_navigate", {"url": "http://127.0.0.1:9/"})
    assert unsafe["error"].startswith("navigate failed: Page.goto: net::ERR_UNSAFE_PORT at http://127.0.0.1:9/\n")
    blank = await client.tool("browser_navigate", {"url": "about:foo"})
    assert blank == {"observation": "URL: about:foo\nTITLE: \nELEMENTS:", "done": False, "error": None}


async def test_typed_text_is_stored_but_not_shown_and_the_form_button_reads_it(client) -> None:
    await seeded(
        client, task_data={"initial_url": "site/form.html", "verifier_metadata": {"dom_contains": "welcome NEO"}}
    )
    await client.tool("browser_observe")
    typed = await client.tool("browser_type", {"element_id": 0, "text": "neo"})
    assert typed["observation"] == (
        f"URL: {FORM_URL}\nTITLE: Form\nELEMENTS:\n  [0] input: \n  [1] button: Submit\nTEXT:\n  Login Form Submit"
    )
    submitted = await client.tool("browser_click", {"element_id": 1})
    assert "\nTITLE: Welcome neo\n" in submitted["observation"]
    assert (await client.post("verify", VERIFY_BODY))[1]["reward"] == 1.0


async def test_typing_into_a_button_is_a_page_error(client) -> None:
    await seeded(client, task_data={"initial_url": "site/form.html"})
    await client.tool("browser_observe")
    answer = await client.tool("browser_type", {"element_id": 1, "text": "x"})
    assert answer["error"].startswith(
        "type failed: ElementHandle.fill: Error: Element is not an <input>, <textarea>, <select> or [contenteditable]"
    )


async def test_the_first_finish_wins_and_its_snapshot_is_graded(client) -> None:
    await seeded(client)
    await client.tool("browser_observe")
    await client.tool("browser_click", {"element_id": 1})  # About
    await client.tool("browser_finish", {"answer": "first"})
    await client.tool("browser_navigate", {"url": INDEX_URL})  # the episode wanders on
    await client.tool("browser_finish", {"answer": "second"})

    assert (await client.post("verify", VERIFY_BODY))[1]["reward"] == 1.0  # url_contains about.html


async def test_finish_unbinds_every_element_id(client) -> None:
    await seeded(client)
    await client.tool("browser_observe")
    await client.tool("browser_finish", {"answer": ""})
    answer = await client.tool("browser_click", {"element_id": 0})
    assert answer["error"] == "click failed: 'element_id 0 not in last observation; call browser_observe first'"


async def test_a_custom_site_truncates_elements_and_text_like_the_real_server() -> None:
    words = " ".join(f"w{i}" for i in range(700))
    elements = (
        Element(tag="a", name="hidden", href="/", visible=False),
        Element(tag="div", name="Role   button\n with spaces"),
        text_input("q", value="preset"),
        link("N" * 100, "/"),
        *(link(f"Link {i}", "/") for i in range(60)),
    )
    site = Site({"http://big.test/": Page(title=" Big  Page ", text=f"Big\n\n{words}", elements=elements)})
    async with InProcessEnvironmentServer(site, max_elements=50) as server:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=CLIENT_TIMEOUT) as s:
            client = Client(server, s)
            await seeded(client, task_data={"initial_url": "http://big.test"})
            lines = (await client.tool("browser_observe"))["observation"].split("\n")
    assert lines[:7] == [
        "URL: http://big.test/",
        "TITLE: Big Page",
        "ELEMENTS:",
        "  [0] div: Role button with spaces",
        "  [1] input: preset",
        "  [2] a: " + "N" * 80,
        "  [3] a: Link 0",
    ]
    assert lines[52:55] == ["  [49] a: Link 46", "  ... (truncated at 50 elements)", "TEXT:"]
    assert len(lines[55]) == 2 + 2000
    assert lines[56:] == ["  ... (truncated)"]


# ------------------------------------------------------------------------------------------------------------------
# Verify
# ------------------------------------------------------------------------------------------------------------------


async def test_verify_requires_responses_create_params_and_response(client) -> None:
    await seeded(client)
    assert await client.post("verify", {}) == (
        422,
        {
            "detail": [
                {"type": "missing", "loc": ["body", "responses_create_params"], "msg": "Field required", "input": {}},
                {"type": "missing", "loc": ["body", "response"], "msg": "Field required", "input": {}},
            ]
        },
    )
    status, answer = await client.post("verify", {"responses_create_params": {"input": "hi"}})
    assert (status, [error["loc"] for error in answer["detail"]]) == (422, [["body", "response"]])


@pytest.mark.parametrize(
    ("verifier_metadata", "answer", "reward"),
    [
        ({"answer_equals": "ALPHA-42"}, " ALPHA-42 ", 1.0),
        ({"answer_equals": "alpha-42"}, "ALPHA-42", 0.0),
        ({"answer_equals": "ALPHA-42", "url_contains": "index.html"}, "ALPHA-42", 1.0),
        ({"answer_equals": "nope", "url_contains": "about.html"}, "ALPHA-42", 0.0),
        ({"final_url": ABOUT_URL, "url_contains": "nowhere"}, "", 1.0),
        ({"final_url": ABOUT_URL + "#", "url_contains": "about.html"}, "", 0.0),
        ({"url_contains": "about.html", "dom_contains": "nowhere"}, "", 1.0),
        ({"dom_contains": "secret CODE: alpha"}, "", 1.0),
        ({"dom_contains": "about secret"}, "", 0.0),  # title + raw text: "About About Lexmount\n\nSecret ..."
        ({"finl_url": "typo", "dom_contains": "Lexmount"}, "", 1.0),  # an unknown key next to a known one is ignored
    ],
)
async def test_verify_tries_answer_equals_then_final_url_then_url_contains_then_dom_contains(
    client, verifier_metadata, answer, reward
) -> None:
    await seeded(client, task_data={"initial_url": "site/about.html", "verifier_metadata": verifier_metadata})
    await client.tool("browser_finish", {"answer": answer})
    status, verdict = await client.post("verify", VERIFY_BODY)
    assert (status, verdict["reward"], verdict["failure_reason"]) == (200, reward, None)


async def test_an_episode_that_never_finished_is_graded_on_the_live_page(client) -> None:
    await seeded(client)
    await client.tool("browser_observe")
    await client.tool("browser_click", {"element_id": 1})
    assert (await client.post("verify", VERIFY_BODY))[1]["reward"] == 1.0


async def test_verify_without_a_supported_key_answers_500_and_still_releases_the_browser(server, client) -> None:
    await seeded(client, task_data={"initial_url": "site/index.html", "verifier_metadata": {"finl_url": "x"}})
    assert await client.post("verify", VERIFY_BODY) == (
        500,
        "ValueError(\"verifier_metadata has no supported scoring key (got ['finl_url']; "
        "expected one of ['final_url', 'url_contains', 'dom_contains', 'answer_equals'])\")",
    )
    assert server.open_sessions == 0


async def test_a_second_verify_reports_the_session_missing_as_an_unmasked_zero(server, client) -> None:
    await seeded(client)
    await client.post("verify", VERIFY_BODY)
    assert server.open_sessions == 0
    status, verdict = await client.post("verify", VERIFY_BODY)
    assert status == 200
    assert (verdict["reward"], verdict["mask_sample"], verdict["failure_reason"]) == (
        0.0,
        False,
        SESSION_NOT_FOUND_AT_VERIFY,
    )
    assert (await client.tool("browser_observe"))["error"] == NO_SESSION_ERROR


async def test_verify_echoes_the_responses_objects_with_their_defaults(client) -> None:
    await seeded(client)
    verdict = (await client.post("verify", VERIFY_BODY))[1]
    assert list(verdict) == [
        "responses_create_params",
        "response",
        "reward",
        "mask_sample",
        "failure_kind",
        "failure_reason",
    ]
    assert verdict["responses_create_params"]["input"] == "hi"
    assert verdict["responses_create_params"]["tool_choice"] == "auto"
    assert (verdict["response"]["id"], verdict["response"]["created_at"], verdict["response"]["usage"]) == (
        "r",
        0.0,
        None,
    )


# ------------------------------------------------------------------------------------------------------------------
# Faults
# ------------------------------------------------------------------------------------------------------------------


async def test_a_stopped_server_refuses_connections_until_it_starts_again_on_the_same_port(server, client) -> None:
    await seeded(client)
    url = server.url
    async with server.refusing_connections():
        with pytest.raises(aiohttp.ClientConnectorError):
            await client.post("browser_observe", {})
    assert server.url == url
    assert (await client.tool("browser_observe"))["observation"] == INDEX_OBSERVATION  # a network outage only


async def test_a_restarted_server_has_forgotten_every_session_but_still_reads_the_cookie(server, client) -> None:
    await seeded(client)
    await server.restart()
    assert server.open_sessions == 0
    assert (await client.tool("browser_observe"))["error"] == NO_SESSION_ERROR
    verdict = (await client.post("verify", VERIFY_BODY))[1]
    assert verdict["failure_reason"] == SESSION_NOT_FOUND_AT_VERIFY
    assert server.events("s-1") == ["seed", "observe", "verify"]  # the cookie still names the session


async def test_an_injected_5xx_answers_only_the_nth_call(server, client) -> None:
    await seeded(client)
    rule = server.inject("browser_observe", Fault.status(503), on_call=2)
    statuses = [(await client.post("browser_observe", {}))[0] for _ in range(3)]
    assert statuses == [200, 503, 200]
    assert (rule.seen, rule.fired) == (3, 1)


async def test_a_fault_without_on_call_fires_on_every_matching_call_up_to_times(server, client) -> None:
    await seeded(client)
    server.inject("*", Fault.status(502, body="Bad Gateway", content_type="text/plain"), times=2)
    first = await client.post("browser_observe", {})
    second = await client.post("browser_click", {"element_id": 0})
    third = await client.post("browser_observe", {})
    assert (first, second, third[0]) == ((502, "Bad Gateway"), (502, "Bad Gateway"), 200)


async def test_when_two_rules_are_due_the_first_added_acts_and_both_count_the_call(server, client) -> None:
    await seeded(client)
    first = server.inject("browser_observe", Fault.status(503), on_call=1)
    second = server.inject("browser_observe", Fault.status(504), on_call=2, times=1)
    statuses = [(await client.post("browser_observe", {}))[0] for _ in range(3)]
    assert statuses == [503, 504, 200]
    assert (first.seen, first.fired, second.seen, second.fired) == (3, 1, 3, 1)


async def test_the_default_5xx_body_is_the_repr_json_string_nemo_gym_sends(server, client) -> None:
    server.inject("verify", Fault.status())
    assert await client.post("verify", VERIFY_BODY) == (500, "RuntimeError('injected fault: HTTP 500')")


async def test_a_fault_can_target_one_session(server) -> None:
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=CLIENT_TIMEOUT) as one,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=CLIENT_TIMEOUT) as two,
    ):
        first, second = Client(server, one), Client(server, two)
        await seeded(first, "s-1")
        await seeded(second, "s-2")
        server.inject("browser_observe", Fault.status(500), session_id="s-2")
        assert (await first.post("browser_observe", {}))[0] == 200
        assert (await second.post("browser_observe", {}))[0] == 500


async def test_a_hang_outlasts_the_client_timeout_and_the_server_stays_usable(server, client) -> None:
    await seeded(client)
    server.inject("browser_observe", Fault.hang(30.0), times=1)
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await client.post("browser_observe", {}, timeout=aiohttp.ClientTimeout(total=0.2))
    assert time.monotonic() - started < 5.0
    assert (await client.tool("browser_observe"))["observation"] == INDEX_OBSERVATION
    assert server.events("s-1") == ["seed", "observe", "observe"]


async def test_a_hang_shorter_than_the_client_timeout_only_delays_the_answer(server, client) -> None:
    await seeded(client)
    server.inject("browser_observe", Fault.hang(0.2), times=1)
    started = time.monotonic()
    answer = await client.tool("browser_observe")
    assert time.monotonic() - started >= 0.2
    assert answer["observation"] == INDEX_OBSERVATION


async def test_a_lost_session_answers_no_active_session_and_verify_reports_it_missing(server, client) -> None:
    await seeded(client)
    await client.tool("browser_observe")
    server.inject("browser_click", Fault.lose_session(), on_call=1)

    assert (await client.tool("browser_click", {"element_id": 1}))["error"] == NO_SESSION_ERROR
    assert server.open_sessions == 0
    verdict = (await client.post("verify", VERIFY_BODY))[1]
    assert (verdict["reward"], verdict["mask_sample"], verdict["failure_reason"]) == (
        0.0,
        False,
        SESSION_NOT_FOUND_AT_VERIFY,
    )


async def test_a_failed_seed_answers_500_and_opens_no_browser(server, client) -> None:
    server.inject("seed_session", Fault.fail_seed(), on_call=1)
    status, answer = await client.post("seed_session", typed_seed("s-1"))
    assert status == 500
    assert answer.startswith("Error('Page.goto: net::ERR_NAME_NOT_RESOLVED at http://unreachable.invalid/")
    assert server.open_sessions == 0
    await seeded(client, "s-1")  # the next attempt goes through
    assert server.events("s-1") == ["seed", "seed"]


async def test_a_seed_can_answer_a_body_without_the_session_id(server, client) -> None:
    server.inject("seed_session", Fault.respond({"unexpected": True}))
    assert await client.post("seed_session", typed_seed("s-1")) == (200, {"unexpected": True})


async def test_a_connection_dropped_mid_response_cuts_the_body_short(server, client) -> None:
    await seeded(client)
    server.inject("browser_observe", Fault.drop_connection(b'{"observation": "URL'), times=1)
    with pytest.raises(aiohttp.ClientPayloadError):
        await client.post("browser_observe", {})
    assert (await client.tool("browser_observe"))["observation"] == INDEX_OBSERVATION


async def test_a_connection_dropped_before_any_byte_is_a_server_disconnect(server, client) -> None:
    await seeded(client)
    server.inject("verify", Fault.drop_connection(None), times=1)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post("verify", VERIFY_BODY)
    assert server.open_sessions == 1  # the request never reached verify


async def test_a_malformed_json_answer_does_not_decode(server, client) -> None:
    await seeded(client)
    server.inject("browser_observe", Fault.malformed_json(), times=1)
    async with client.session.post(f"{server.url}/browser_observe", json={}) as response:
        assert (response.status, response.content_type) == (200, "application/json")
        with pytest.raises(json.JSONDecodeError):
            await response.json()


async def test_a_crashed_browser_fails_page_calls_and_verify_reports_it_unreachable(server, client) -> None:
    await seeded(client)
    server.inject("browser_observe", Fault.crash_browser(), on_call=1)
    answer = await client.tool("browser_observe")
    assert answer["error"] == "observe failed: Locator.count: Target page, context or browser has been closed"
    verdict = (await client.post("verify", VERIFY_BODY))[1]
    assert (verdict["reward"], verdict["mask_sample"], verdict["failure_reason"]) == (
        0.0,
        False,
        "browser unreachable while scoring: TargetClosedError: "
        "Locator.count: Target page, context or browser has been closed",
    )
    assert server.open_sessions == 0


async def test_a_regrade_plants_the_reward_in_the_graded_answer_and_verify_still_releases_the_browser(
    server, client
) -> None:
    await seeded(client)  # still on the home page: the task (the about page) grades 0
    server.inject("verify", Fault.regrade(1.0), on_call=1)
    status, verdict = await client.post("verify", VERIFY_BODY)
    assert (status, verdict["reward"], verdict["failure_reason"]) == (200, 1.0, None)
    assert server.open_sessions == 0


async def test_a_rule_sees_every_call_with_its_session_and_task_and_its_fault_acts_on_that_call(server, client) -> None:
    seen = []

    def rule(request: SeenRequest) -> Fault | None:
        seen.append((request.endpoint, request.session_id, request.task_id))
        return Fault.status(503) if request.endpoint == "browser_click" else None

    server.set_rule(rule)
    await seeded(client)
    statuses = [(await client.post("browser_click", {"element_id": 1}))[0]]
    server.inject("browser_observe", Fault.status(504), on_call=1)  # an injected fault acts first: no rule asked
    statuses.append((await client.post("browser_observe", {}))[0])

    assert statuses == [503, 504]
    assert seen == [("seed_session", "s-1", "task-1"), ("browser_click", "s-1", "task-1")]
    assert server.calls("browser_click") == 1 and server.events("s-1") == ["seed", "click", "observe"]


async def test_a_fixed_latency_delays_every_call(server, client) -> None:
    server.set_latency(0.1)
    started = time.monotonic()
    await seeded(client)
    await client.tool("browser_observe")
    assert time.monotonic() - started >= 0.2


async def test_a_per_endpoint_latency_delays_that_endpoint(server, client) -> None:
    await seeded(client)
    server.set_latency(0.2, "browser_observe")
    started = time.monotonic()
    await client.tool("browser_observe")
    assert time.monotonic() - started >= 0.2


async def test_a_seed_cancelled_while_its_browser_opens_leaves_an_orphan_like_the_real_server() -> None:
    async with InProcessEnvironmentServer(browser_open_s=2.0) as server:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            client = Client(server, session)
            with pytest.raises(asyncio.TimeoutError):
                await client.post("seed_session", typed_seed("s-1"), timeout=aiohttp.ClientTimeout(total=0.2))
            for _ in range(100):  # the server notices the disconnect shortly after the client gives up
                if server.orphaned_browsers:
                    break
                await asyncio.sleep(0.02)
        assert (server.orphaned_browsers, server.open_sessions) == (1, 0)


async def test_the_event_log_and_open_sessions_show_a_session_left_open(server, client) -> None:
    await seeded(client, "kept")
    await client.tool("browser_observe")
    assert server.events("kept") == ["seed", "observe"]
    assert server.open_session_ids == ("kept",)
    assert server.calls("browser_observe") == 1


def test_inject_rejects_an_unknown_endpoint() -> None:
    with pytest.raises(ValueError, match="unknown endpoint"):
        InProcessEnvironmentServer().inject("browser_scroll", Fault.status())


def test_the_threaded_server_serves_synchronous_callers_and_restarts() -> None:
    with InProcessEnvironmentServer().run_in_thread() as env:
        host, port = env.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            connection.request(
                "POST", "/seed_session", json.dumps(typed_seed("s-1")), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            cookie = response.getheader("Set-Cookie").split(";")[0]
            assert (response.status, json.loads(response.read())["resources_session_id"]) == (200, "s-1")

            env.restart_server()
            connection.close()
            connection.request("POST", "/browser_observe", "{}", {"Content-Type": "application/json", "Cookie": cookie})
            response = connection.getresponse()
            assert json.loads(response.read())["error"] == NO_SESSION_ERROR
        finally:
            connection.close()
        assert env.server.events("s-1") == ["seed", "observe"]


async def test_a_test_site_can_link_pages_and_run_click_handlers() -> None:
    def checkout(page) -> str | None:
        return "/done" if page.value("qty") == "2" else None

    site = Site(
        {
            "http://shop.test/": Page(
                title="Shop", text="Shop\nQty Buy", elements=(text_input("qty"), button("Buy", on_click=checkout))
            ),
            "http://shop.test/done": Page(title="Thanks", text="Order placed"),
        }
    )
    async with InProcessEnvironmentServer(site) as server:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=CLIENT_TIMEOUT) as s:
            client = Client(server, s)
            task = {"initial_url": "http://shop.test/", "verifier_metadata": {"final_url": "http://shop.test/done"}}
            await seeded(client, task_data=task)
            anchored = await client.tool("browser_navigate", {"url": "http://shop.test/#reviews"})
            assert anchored["observation"].startswith("URL: http://shop.test/#reviews\nTITLE: Shop\n")
            await client.tool("browser_click", {"element_id": 1})
            assert "TITLE: Shop" in (await client.tool("browser_observe"))["observation"]
            await client.tool("browser_type", {"element_id": 0, "text": "2"})
            done = await client.tool("browser_click", {"element_id": 1})
            assert done["observation"] == "URL: http://shop.test/done\nTITLE: Thanks\nELEMENTS:\nTEXT:\n  Order placed"
            assert (await client.post("verify", VERIFY_BODY))[1]["reward"] == 1.0
