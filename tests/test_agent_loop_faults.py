"""Many concurrent rollouts under a schedule of injected faults: every fault accounted for, nothing left open."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.in_process_loop import build_loop, compose_trainer_config, load_tools, make_row

ABOUT = {"url_contains": "about.html"}
ROLLOUTS = 32
ATTEMPTS = 4
BROKEN = 4  # rollouts whose task needs browser_type, which fails on every call: exhausted, then dropped
# (endpoint, fault, the Nth call of that endpoint it hits, the kind the loop must record)
SCHEDULE = [
    ("seed_session", Fault.fail_seed(), 3, "seed_failed"),
    ("seed_session", Fault.status(500), 20, "seed_failed"),
    ("browser_observe", Fault.crash_browser(), 7, "session_lost"),
    ("browser_click", Fault.status(503), 2, "server_error"),
    ("browser_click", Fault.lose_session(), 9, "session_lost"),
    ("browser_click", Fault.hang(30), 13, "timeout"),
    ("browser_click", Fault.malformed_json(), 21, "server_error"),
    ("verify", Fault.status(500), 5, "verify_unavailable"),
    ("verify", Fault.lose_session(), 11, "session_lost"),
]


@pytest.mark.parametrize("drop", [False, True])
async def test_every_injected_fault_is_one_failed_attempt_of_its_kind_and_every_session_is_closed(drop, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_BROWSER_DROP_INVALID", "1" if drop else "0")
    tokenizer = build_chat_tokenizer()
    config, tools = compose_trainer_config(), load_tools()
    scripts = {"walk": sp.walk_and_finish("About", "x"), "type": sp.steps(sp.observe(), sp.type_into("x", "y"))}
    v1 = {"uid": "u", "session_id": 0, "global_steps": 1}

    async with InProcessEnvironmentServer() as server:
        rules = [(server.inject(endpoint, fault, on_call=n), kind) for endpoint, fault, n, kind in SCHEDULE]
        rules.append((server.inject("browser_type", Fault.status(503)), "server_error"))
        # Only the hung click may time out: 5 s holds every other call on a loaded machine, whose event loop (shared
        # by the 32 rollouts and the server) wakes seconds late; the hang (30 s) outlasts it.
        environment = {"server_urls": [server.url], "call_timeout_s": 5.0, "retry_backoff_s": 0.01}
        loops = [
            build_loop(
                sp.ScriptedPolicy(tokenizer, scripts),
                tokenizer=tokenizer,
                tools=tools,
                trainer_config=config,
                environment=environment,
                max_attempts=ATTEMPTS,
                resample_backoff_s=0,
                resume={"max_per_episode": 0},  # each fault ends its attempt (resumes: test_resume.py)
            )
            for _ in range(ROLLOUTS)
        ]
        rows = [
            make_row(task=("type" if i < BROKEN else "walk") + " to About", verifier_metadata=ABOUT, index=i)
            for i in range(ROLLOUTS)
        ]
        outputs = await asyncio.gather(*(loop.run({}, **row, **v1) for loop, row in zip(loops, rows, strict=True)))
        await close_shared_clients()

        assert server.open_sessions == 0
        assert all(server.events(s)[-1] == "close" for s in server.session_ids)

    assert all(rule.fired for rule, _ in rules)  # the run was long enough for every scheduled fault
    injected = Counter(kind for rule, kind in rules for _ in range(rule.fired))
    kept = [o for o in outputs if isinstance(o, AgentLoopOutput)]
    recorded = Counter(kind for o in kept for kind in o.extra_fields["env_failed_attempt_kinds"])
    broken, walkers = outputs[:BROKEN], outputs[BROKEN:]
    if drop:
        assert broken == [[]] * BROKEN
        # Each dropped rollout took ATTEMPTS faults with it; the kept ones account for all the others.
        assert sum(recorded.values()) == sum(injected.values()) - ATTEMPTS * BROKEN
    else:
        assert [o.extra_fields["env_failure_kind"] for o in broken] == ["server_error"] * BROKEN
        assert all(o.extra_fields["env_attempts"] == ATTEMPTS and set(o.response_mask) == {0} for o in broken)
        assert recorded == injected  # every injected fault is one failed attempt, of the kind injected
    # The walkers all recovered, each after exactly as many failed attempts as faults it met.
    assert all(isinstance(o, AgentLoopOutput) and o.reward_score == 1.0 for o in walkers)
    assert not any(o.extra_fields["env_invalid"] for o in walkers)
    assert all(o.extra_fields["env_attempts"] == 1 + len(o.extra_fields["env_failed_attempt_kinds"]) for o in walkers)
    assert sum(o.extra_fields["env_attempts"] > 1 for o in walkers) >= 1
