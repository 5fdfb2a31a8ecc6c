"""Faults at browser calls hit an episode once per call it makes, as real infrastructure does, and never its answer.

The rule (``faults.injected.browser_call_faults``) on its own: a deterministic draw per browser call, the rate it was
given, the endpoints it leaves alone. Then through the real agent loop, with a scripted policy, the real fault
proxy and the in-process environment server: a browsing episode hit at a browser call ends as an infrastructure failure
of the kind injected and is re-run, an episode that finishes at once meets no fault.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.gym_contract.session_ids import parse_session_id
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.faults.injected import browser_call_faults
from nemo_gym_browser.local.faults.kinds import SeenRequest
from nemo_gym_browser.local.faults.proxy import FaultProxy
from nemo_gym_browser.local.in_process_loop import build_loop, make_row

BROWSER_CALLS = ("browser_observe", "browser_navigate", "browser_click", "browser_type")
NEVER_FAULTED = ("seed_session", "browser_finish", "verify", "close_session")


def request(endpoint: str, session_id: str | None, task_id: str | None = "train") -> SeenRequest:
    return SeenRequest(endpoint=endpoint, session_id=session_id, received_at=0.0, task_id=task_id)


def faulted_calls(rule, traffic: list[tuple[str, str]]) -> set[tuple[str, int]]:
    """``(session, index among its browser calls)`` of every call ``rule`` faults when ``traffic`` reaches it."""
    hit, seen = set(), {}
    for endpoint, session in traffic:
        fault = rule(request(endpoint, session))
        if endpoint in BROWSER_CALLS:
            index = seen[session] = seen.get(session, -1) + 1
            if fault is not None:
                hit.add((session, index))
        else:
            assert fault is None, f"{endpoint} was faulted"
    return hit


def session_traffic(session: str, calls: int) -> list[tuple[str, str]]:
    """One session's requests in order: seed, ``calls`` browser calls, finish, verify, close."""
    middle = [BROWSER_CALLS[i % len(BROWSER_CALLS)] for i in range(calls)]
    return [(endpoint, session) for endpoint in ("seed_session", *middle, "browser_finish", "verify", "close_session")]


def interleaved(sessions: list[list[tuple[str, str]]], rng: random.Random) -> list[tuple[str, str]]:
    """The sessions' requests shuffled together, each session's own order kept (as concurrent episodes arrive)."""
    queues = [list(s) for s in sessions]
    merged = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        merged.append(queue.pop(0))
    return merged


# ----- the rule ----------------------------------------------------------------------------------------------


def test_a_browser_calls_draw_depends_on_seed_session_and_its_place_in_the_session_not_on_arrival_order() -> None:
    sessions = [session_traffic(f"r{i}-{i:04x}.1.{i}", calls=12) for i in range(40)]
    in_turn = [entry for s in sessions for entry in s]
    shuffled = interleaved(sessions, random.Random(3))
    assert shuffled != in_turn

    hit = faulted_calls(browser_call_faults(0.3, seed=7), in_turn)

    assert 0 < len(hit) < 40 * 12
    assert faulted_calls(browser_call_faults(0.3, seed=7), shuffled) == hit
    assert faulted_calls(browser_call_faults(0.3, seed=8), in_turn) != hit
    # A session's draws do not depend on which other sessions share the proxy.
    alone = faulted_calls(browser_call_faults(0.3, seed=7), sessions[5])
    assert alone == {call for call in hit if call[0] == sessions[5][0][1]}


def test_over_many_browser_calls_the_share_faulted_converges_to_the_rate() -> None:
    rule = browser_call_faults(0.25, seed=1)
    traffic = [entry for i in range(400) for entry in session_traffic(f"r{i}-{i:04x}.1.{i}", calls=50)]
    share = len(faulted_calls(rule, traffic)) / (400 * 50)
    assert 0.235 < share < 0.265  # five standard deviations of 20,000 draws


def test_seed_finish_verify_and_close_are_never_faulted_while_every_browser_call_is_at_rate_one() -> None:
    rule = browser_call_faults(1.0, seed=0, kind="lose_session")
    session = "r0-abcd.1.0"
    assert all(rule(request(endpoint, session)) is None for endpoint in NEVER_FAULTED)
    assert [rule(request(endpoint, session)).kind for endpoint in BROWSER_CALLS] == ["lose_session"] * 4
    assert rule(request("browser_observe", None)) is None  # a request of no session belongs to no episode
    assert browser_call_faults(1.0, seed=0)(request("browser_click", session)).kind == "status"
    assert browser_call_faults(1.0, seed=0, kind="hang")(request("browser_click", session)).kind == "hang"


def test_sessions_of_spared_tasks_are_never_faulted() -> None:
    rule = browser_call_faults(1.0, seed=0, spare_tasks=frozenset({"held-back"}))
    assert all(rule(request(e, "r1-aa.1.0", task_id="held-back")) is None for e in BROWSER_CALLS * 3)
    assert rule(request("browser_observe", "r2-bb.1.1", task_id="train")) is not None


def test_a_rate_outside_zero_to_one_or_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="rate"):
        browser_call_faults(1.5, seed=0)
    with pytest.raises(ValueError, match="unknown fault"):
        browser_call_faults(0.5, seed=0, kind="typo")


# ----- through the real loop -----------------------------------------------------------------------------------

BROWSE = "browse to the About page"
RECALL = "answer from memory"
SCRIPTS = {BROWSE: sp.walk_and_finish("About", "x"), RECALL: sp.steps(sp.finish("x"))}


def first_attempts_only(rule):
    """``rule`` on the rollouts' first attempts only, so the re-run shows what a resample recovers."""
    return lambda request: rule(request) if (parse_session_id(request.session_id) or (0, 0))[1] == 1 else None


@pytest.mark.parametrize(
    ("kind", "recorded"), [("status", "server_error"), ("lose_session", "session_lost"), ("hang", "timeout")]
)
async def test_a_browsing_episode_hit_at_a_browser_call_is_resampled_and_one_that_answers_at_once_is_never_hit(
    kind, recorded, tokenizer, trainer_config, tools
) -> None:
    async with InProcessEnvironmentServer() as server, FaultProxy(server.url, upstream_timeout_s=10) as proxy:
        proxy.set_rule(first_attempts_only(browser_call_faults(1.0, seed=0, kind=kind)))
        environment = {"server_urls": [proxy.url], "call_timeout_s": 0.5, "retry_backoff_s": 0.01}
        rows = [
            make_row(task=BROWSE, task_id="browse", verifier_metadata={"url_contains": "about.html"}, index=0),
            make_row(task=RECALL, task_id="recall", verifier_metadata={"answer_equals": "x"}, index=1),
        ]
        loops = [
            build_loop(
                sp.ScriptedPolicy(tokenizer, SCRIPTS),
                tokenizer=tokenizer,
                tools=tools,
                trainer_config=trainer_config,
                environment=environment,
                max_attempts=3,
                resample_backoff_s=0,
                resume={"max_per_episode": 0},  # the rule's draws, one per session: no resume in between
            )
            for _ in rows
        ]
        try:
            browsed, recalled = await asyncio.gather(
                *(loop.run({}, **row) for loop, row in zip(loops, rows, strict=True))
            )
        finally:
            await close_shared_clients()
        assert server.open_sessions == 0

    assert browsed.extra_fields["env_failed_attempt_kinds"] == [recorded]  # infrastructure, not a policy zero
    assert browsed.extra_fields["env_attempts"] == 2 and not browsed.extra_fields["env_invalid"]
    assert browsed.reward_score == 1.0
    assert recalled.extra_fields["env_attempts"] == 1 and recalled.extra_fields["env_failed_attempt_kinds"] == []
    assert recalled.reward_score == 1.0
    faulted = [(e.request.endpoint, parse_session_id(e.request.session_id)) for e in proxy.log if e.fault]
    assert faulted == [("browser_observe", (0, 1))]  # the browsing episode's first call, on its first attempt
    recall_calls = [e.request.endpoint for e in proxy.log if (parse_session_id(e.request.session_id) or (0,))[0] == 1]
    assert recall_calls == list(NEVER_FAULTED)  # seed, finish, verify, close: nothing a browser-call fault reaches
