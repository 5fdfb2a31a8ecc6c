"""BrowserToolAgentLoop on verl 0.9.1's real ToolAgentLoop machinery, a scripted policy and the in-process environment
server.

Every loop is built from ``configs/agent_loop.yaml`` by ``hydra.utils.instantiate`` with the keyword arguments
verl's ``AgentLoopWorker`` passes, over verl's composed ``ppo_trainer`` config and tools loaded by verl's
``initialize_tools_from_config`` from the recipe's tool configs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.environment_server.site_model import BUNDLED_ROOT
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.in_process_loop import build_loop, compose_trainer_config, load_tools, make_row
from nemo_gym_browser.settings import DROP_INVALID_ENV, BrowserLoopSettings

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
ABOUT = {"url_contains": "about.html"}
ABOUT_URL = BUNDLED_ROOT + "site/about.html"
WALK = sp.walk_and_finish("About", "ALPHA-42")
# Generations of WALK: observe, click, finish (the episode ends at finish without another model call).
WALK_TURNS = 3
# A per-call timeout for the tests that hang one call on purpose: seconds, so that on a loaded machine (event loops
# waking a second or two late) no other call of the test can time out; each injected hang outlasts it.
HANG_CALL_TIMEOUT_S = 3.0
FAST_ENV = {
    "call_timeout_s": 2.0,
    "seed_timeout_s": 2.0,
    "verify_timeout_s": 2.0,
    "close_timeout_s": 2.0,
    "retry_backoff_s": 0.01,
    "server_cooldown_s": 0.5,
}


class Harness:
    def __init__(self, server, tokenizer, tools, trainer_config):
        self.server = server
        self.tokenizer = tokenizer
        self.tools = tools
        self.trainer_config = trainer_config

    def loop(self, script, *, think_time_s=0.0, urls=None, environment=None, trainer_config=None, tools=None, **kw):
        policy = sp.ScriptedPolicy(self.tokenizer, script, think_time_s=think_time_s)
        kw.setdefault("resample_backoff_s", 0)
        loop = build_loop(
            policy,
            tokenizer=self.tokenizer,
            tools=tools if tools is not None else self.tools,
            trainer_config=trainer_config if trainer_config is not None else self.trainer_config,
            environment={"server_urls": urls or [self.server.url], **FAST_ENV, **(environment or {})},
            **kw,
        )
        return loop, policy

    async def run(self, script, *, row=None, extra=None, **kw) -> tuple[AgentLoopOutput, sp.ScriptedPolicy]:
        loop, policy = self.loop(script, **kw)
        row = row if row is not None else make_row(task="Open the About page", verifier_metadata=ABOUT)
        return await loop.run(SAMPLING, **row, **(extra or {})), policy

    def text(self, output: AgentLoopOutput) -> str:
        return self.tokenizer.decode(output.response_ids)

    def all_closed(self) -> bool:
        ids = self.server.session_ids
        return bool(ids) and self.server.open_sessions == 0 and all(self.server.events(s)[-1] == "close" for s in ids)


@pytest.fixture
def h(server, tokenizer, tools, trainer_config):
    return Harness(server, tokenizer, tools, trainer_config)


def flags(output: AgentLoopOutput) -> dict:
    keys = ("env_invalid", "env_failure_kind", "env_attempts", "deadline_hit", "reward_source")
    return {key: output.extra_fields[key] for key in keys}


VALID_VERIFY = {"env_invalid": False, "env_failure_kind": None, "deadline_hit": False, "reward_source": "verify"}


# ----- a whole episode ----------------------------------------------------------------------------------------


async def test_a_scripted_episode_seeds_observes_clicks_finishes_verifies_closes_and_scores_one(h):
    output, policy = await h.run(WALK)

    assert output.reward_score == 1.0
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 1}
    (session,) = h.server.session_ids
    assert h.server.events(session) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert h.server.open_sessions == 0
    assert policy.calls == WALK_TURNS
    # The observation reached the model whole (verl's 256-character default would have cut it).
    text = h.text(output)
    assert "[1] a: About" in text and "Secret code: ALPHA-42" in text
    # The response ends on the model's finish call, which carries the reward, not on a tool turn.
    assert output.response_mask[-1] == 1 and text.endswith("</tool_call><|im_end|>")
    assert output.response_mask.count(1) > 0 and output.response_mask.count(0) > 0
    assert output.extra_fields["env_browser_actions"] == 2  # observe and click; finish does not count
    assert output.extra_fields["reward_extra_info"]["env/browsed"] == 1.0


async def test_an_answer_given_at_once_is_recorded_as_not_browsed(h):
    output, _ = await h.run(sp.steps(sp.finish("a guess")))

    (session,) = h.server.session_ids
    assert h.server.events(session) == ["seed", "finish", "verify", "close"]
    assert output.extra_fields["env_browser_actions"] == 0
    assert output.extra_fields["reward_extra_info"]["env/browsed"] == 0.0


async def test_native_tools_drive_the_same_episode_under_nemo_gym_tool_names(h):
    native_config = compose_trainer_config(native_tools=True)
    output, _ = await h.run(
        sp.walk_and_finish("About", "ALPHA-42", use_native=True),
        tools=load_tools(native=True),
        trainer_config=native_config,
    )

    assert output.reward_score == 1.0
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 1}
    assert h.server.events(h.server.session_ids[0]) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert '{"name": "browser_click", "arguments": {"element_id": 1}}' in h.text(output)


async def test_concurrent_rollouts_with_full_determinism_keep_their_own_sessions(h):
    config = compose_trainer_config(overrides=["actor_rollout_ref.rollout.full_determinism=true"])
    loops = [h.loop(WALK, trainer_config=config) for _ in range(4)]
    rows = [make_row(task="Open the About page", verifier_metadata=ABOUT, index=i) for i in range(4)]

    outputs = await asyncio.gather(*(loop.run(SAMPLING, **row) for (loop, _), row in zip(loops, rows, strict=True)))

    assert [o.reward_score for o in outputs] == [1.0] * 4
    assert {rid for _, policy in loops for rid in policy.request_ids} == {"det-0"}  # what verl makes them
    assert len(h.server.session_ids) == 4
    for session in h.server.session_ids:
        assert h.server.events(session) == ["seed", "observe", "click", "finish", "verify", "close"]


# ----- infrastructure faults: flagged, resampled, recovered -----------------------------------------------------


def _dead_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


FAULTS = [
    # (endpoint, fault, kind, generations made by the failed first attempt)
    pytest.param("seed_session", Fault.fail_seed(), "seed_failed", 0, id="seed-fails"),
    pytest.param("browser_click", Fault.status(503), "server_error", 2, id="5xx"),
    pytest.param("browser_click", Fault.malformed_json(), "server_error", 2, id="malformed-json"),
    pytest.param("browser_click", Fault.lose_session(), "session_lost", 2, id="session-lost"),
    pytest.param("browser_observe", Fault.crash_browser(), "session_lost", 1, id="browser-crashed"),
    pytest.param("browser_click", Fault.drop_connection(), "unreachable", 2, id="connection-dropped"),
    pytest.param("browser_click", Fault.hang(30), "timeout", 2, id="call-hangs"),
    pytest.param("verify", Fault.status(500), "verify_unavailable", 3, id="verify-5xx"),
    pytest.param("verify", Fault.lose_session(), "session_lost", 3, id="verify-session-gone"),
]


# Resuming off: the re-run path, which is what a failure that cannot be resumed meets (resumes: test_resume.py).
NO_RESUME = {"max_per_episode": 0}


@pytest.mark.parametrize(("endpoint", "fault", "kind", "generations"), FAULTS)
async def test_an_infrastructure_fault_is_flagged_with_its_kind_and_the_rollout_recovers_on_a_new_session(
    h, endpoint, fault, kind, generations
):
    h.server.inject(endpoint, fault, on_call=1)

    output, policy = await h.run(WALK, environment={"call_timeout_s": HANG_CALL_TIMEOUT_S}, resume=NO_RESUME)

    assert output.reward_score == 1.0
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 2}
    assert output.extra_fields["env_failed_attempt_kinds"] == [kind]
    # The failed attempt stopped at once: no model call after the failure, then a whole new episode.
    assert policy.calls == generations + WALK_TURNS
    assert len(h.server.session_ids) == 2
    assert h.server.events(h.server.session_ids[1]) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert h.all_closed()


@pytest.mark.parametrize(("endpoint", "fault", "kind", "generations"), FAULTS)
async def test_a_fault_under_a_call_is_resumed_in_a_new_session_keeping_the_sample_and_the_rest_re_run(
    h, endpoint, fault, kind, generations
):
    h.server.inject(endpoint, fault, on_call=1)

    output, policy = await h.run(WALK, environment={"call_timeout_s": HANG_CALL_TIMEOUT_S})

    resumed = kind not in ("seed_failed", "verify_unavailable")  # no session yet; a grade refused, not a session lost
    assert output.reward_score == 1.0
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 1 if resumed else 2}
    assert output.extra_fields["env_resumed_kinds"] == ([kind] if resumed else [])
    assert output.extra_fields["env_failed_attempt_kinds"] == ([] if resumed else [kind])
    assert policy.calls == (0 if resumed else generations) + WALK_TURNS  # resumed: the model never asked again
    assert len(h.server.session_ids) == 2
    assert h.server.events(h.server.session_ids[1]) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert h.all_closed()


async def test_an_unreachable_server_is_flagged_and_the_rollout_resamples_on_a_healthy_one(h):
    dead = f"http://127.0.0.1:{_dead_port()}"

    output, _ = await h.run(WALK, urls=[dead, h.server.url])

    assert output.reward_score == 1.0
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 2}
    assert output.extra_fields["env_failed_attempt_kinds"] == ["unreachable"]
    assert h.all_closed()


@pytest.mark.parametrize(
    ("endpoint", "fault", "kind"),
    [
        pytest.param("browser_click", Fault.status(502), "server_error", id="5xx"),
        pytest.param("seed_session", Fault.fail_seed(), "seed_failed", id="seed"),
        pytest.param("browser_click", Fault.hang(30), "timeout", id="hang"),
    ],
)
async def test_a_rollout_still_failing_after_its_attempts_is_kept_flagged_invalid_with_its_loss_masked(
    h, endpoint, fault, kind
):
    h.server.inject(endpoint, fault)

    output, _ = await h.run(WALK, max_attempts=3, environment={"call_timeout_s": HANG_CALL_TIMEOUT_S}, resume=NO_RESUME)

    assert flags(output) == {
        "env_invalid": True,
        "env_failure_kind": kind,
        "env_attempts": 3,
        "deadline_hit": False,
        "reward_source": None,
    }
    assert output.extra_fields["env_failed_attempt_kinds"] == [kind] * 3
    assert output.extra_fields["env_failure_reason"].startswith("session ")  # names the session that failed
    assert output.reward_score == 0.0
    assert len(output.response_mask) >= 1 and set(output.response_mask) == {0}

    assert len(h.server.session_ids) == 3 and h.all_closed()


async def test_train_on_failures_keeps_a_failed_rollouts_tokens_in_the_loss_as_a_policy_zero(h):
    h.server.inject("browser_click", Fault.status(502))

    output, _ = await h.run(WALK, max_attempts=1, train_on_failures=True)

    assert flags(output)["env_invalid"] is True and output.reward_score == 0.0
    assert 1 in output.response_mask  # the observe call the policy made is trained on, as without the recipe


async def test_a_hung_call_is_an_infrastructure_timeout_well_before_the_episode_deadline(h):
    h.server.inject("browser_click", Fault.hang(30))
    started = time.monotonic()

    output, _ = await h.run(
        WALK,
        max_attempts=1,
        episode_deadline_s=60,
        environment={"call_timeout_s": HANG_CALL_TIMEOUT_S},
        resume=NO_RESUME,
    )

    assert time.monotonic() - started < HANG_CALL_TIMEOUT_S + 5.0  # the hang (30 s) and the deadline (60 s) are far
    assert flags(output)["env_failure_kind"] == "timeout" and output.extra_fields["env_invalid"] is True
    assert output.extra_fields["deadline_hit"] is False
    assert h.all_closed()


# ----- the drop switch ----------------------------------------------------------------------------------------

V1_KWARGS = {"uid": "uid-1", "session_id": 0, "global_steps": 7}


async def test_with_the_drop_switch_the_v1_trainer_gets_no_sample_for_an_exhausted_rollout(h, monkeypatch):
    monkeypatch.setenv(DROP_INVALID_ENV, "1")
    h.server.inject("browser_click", Fault.status(503))

    output, _ = await h.run(WALK, max_attempts=2, extra=V1_KWARGS, resume=NO_RESUME)

    assert output == []
    assert len(h.server.session_ids) == 2 and h.all_closed()


async def test_the_drop_switch_drops_only_invalid_rollouts(h, monkeypatch):
    monkeypatch.setenv(DROP_INVALID_ENV, "1")

    output, _ = await h.run(WALK, extra=V1_KWARGS)

    assert isinstance(output, AgentLoopOutput) and output.reward_score == 1.0


async def test_the_drop_invalid_setting_overrides_the_environment_variable(h, monkeypatch):
    monkeypatch.setenv(DROP_INVALID_ENV, "1")
    h.server.inject("browser_click", Fault.status(503))

    kept, _ = await h.run(WALK, max_attempts=1, drop_invalid=False, extra=V1_KWARGS)
    monkeypatch.delenv(DROP_INVALID_ENV)
    dropped, _ = await h.run(WALK, max_attempts=1, drop_invalid=True, extra=V1_KWARGS)

    assert isinstance(kept, AgentLoopOutput) and kept.extra_fields["env_invalid"] is True
    assert dropped == []


async def test_without_the_drop_switch_an_exhausted_v1_rollout_is_kept_flagged_with_weight_versions(h, monkeypatch):
    monkeypatch.delenv(DROP_INVALID_ENV, raising=False)
    h.server.inject("seed_session", Fault.fail_seed())

    output, policy = await h.run(WALK, max_attempts=2, extra=V1_KWARGS)

    assert policy.calls == 0
    assert output.extra_fields["env_invalid"] is True and output.extra_fields["env_failure_kind"] == "seed_failed"
    # The model was never called, yet the V1 trainer reads these as integers.
    assert output.extra_fields["min_global_steps"] == 7 and output.extra_fields["max_global_steps"] == 7
    # One masked token carries the reward position verl needs; the V1 conversion accepts the sample.
    assert output.response_mask == [0] and len(output.response_ids) == 1
    converted = output.as_dict()
    assert converted["rm_scores"].tolist() == [0.0] and converted["response_mask"].tolist() == [0]


async def test_under_the_legacy_trainer_the_drop_switch_keeps_the_sample_flagged_and_says_why(h, monkeypatch, caplog):
    monkeypatch.setenv(DROP_INVALID_ENV, "1")
    h.server.inject("browser_click", Fault.status(503))

    with caplog.at_level(logging.ERROR, logger="nemo_gym_browser.browser_agent_loop"):
        output, _ = await h.run(WALK, max_attempts=1)  # legacy: no session_id/global_steps kwargs

    assert isinstance(output, AgentLoopOutput) and output.extra_fields["env_invalid"] is True
    assert set(output.response_mask) == {0}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(DROP_INVALID_ENV in m and "legacy trainer" in m for m in errors)


# ----- the deadline: environment time, a policy outcome; the session hold limit: infrastructure -----------------


class HeldPolicy(sp.ScriptedPolicy):
    """A server manager whose ``generate`` the trainer holds: the turn ``held_turn`` waits ``hold_s`` inside generate
    (a colocate_async training phase, or a request queued in the inference server). Records cancelled requests."""

    def __init__(self, tokenizer, script, *, held_turn: int, hold_s: float) -> None:
        super().__init__(tokenizer, script, think_time_s=lambda view: hold_s if view.turn == held_turn else 0.0)
        self.cancelled = 0

    async def generate(self, request_id, **kwargs):
        try:
            return await super().generate(request_id, **kwargs)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def held_loop(h, script, *, held_turn=1, hold_s=2.0, environment=None, **settings):
    policy = HeldPolicy(h.tokenizer, script, held_turn=held_turn, hold_s=hold_s)
    settings.setdefault("resample_backoff_s", 0)
    loop = build_loop(
        policy,
        tokenizer=h.tokenizer,
        tools=h.tools,
        trainer_config=h.trainer_config,
        environment={"server_urls": [h.server.url], **FAST_ENV, **(environment or {})},
        **settings,
    )
    return loop, policy


async def test_a_generation_held_by_the_trainer_far_past_the_deadline_does_not_end_the_episode(h):
    # The deadline holds the episode's own browser time with room to spare on a loaded machine.
    loop, policy = held_loop(h, WALK, held_turn=1, hold_s=4.5, episode_deadline_s=2.0)

    output = await loop.run(SAMPLING, **make_row(task="Open the About page", verifier_metadata=ABOUT))

    # Over two deadlines passed inside generate; none of it was the environment's time, so nothing was cut.
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 1}
    assert output.reward_score == 1.0 and policy.cancelled == 0
    assert h.server.events(h.server.session_ids[0]) == ["seed", "observe", "click", "finish", "verify", "close"]


async def test_the_deadline_ends_an_episode_whose_browser_time_runs_out_and_it_is_scored_as_it_stands(h):
    deadline = 2.0
    h.server.set_latency(0.1, "browser_observe")
    started = time.monotonic()

    output, policy = await h.run(sp.repeat(sp.observe()), think_time_s=0.05, episode_deadline_s=deadline)

    elapsed = time.monotonic() - started
    # The clock counts browser time only: the model's 0.05 s per turn comes on top of it (and the slack of a
    # loaded machine's late wake-ups on top of that).
    assert deadline <= elapsed < deadline + policy.calls * 0.05 + 4.0
    assert flags(output) == {**VALID_VERIFY, "deadline_hit": True, "env_attempts": 1}
    assert output.reward_score == 0.0  # never reached the About page: a legitimate zero
    assert policy.calls > 3
    assert h.all_closed() and h.server.events(h.server.session_ids[0])[-2:] == ["verify", "close"]


async def test_a_slow_browser_call_in_flight_at_the_deadline_finishes_and_the_episode_ends_as_a_policy_outcome(h):
    # The first call starts well inside the deadline even on a loaded machine, and is still running when it passes.
    h.server.set_latency(3.0, "browser_observe")
    started = time.monotonic()

    output, _ = await h.run(WALK, episode_deadline_s=1.5, environment={"call_timeout_s": 10.0})

    # The call runs to its end (not cut at the deadline), then the deadline ends the episode: scored as it stands.
    assert 3.0 <= time.monotonic() - started < 3.0 + 4.0
    assert flags(output) == {**VALID_VERIFY, "deadline_hit": True, "env_attempts": 1}
    assert output.reward_score == 0.0
    assert h.all_closed()


async def test_a_call_hanging_across_the_deadline_is_an_infrastructure_timeout_not_a_policy_zero(h):
    h.server.set_latency(30.0, "browser_observe")
    started = time.monotonic()

    # The hung call starts well inside the deadline even on a loaded machine, and its timeout comes after it.
    deadline, call_timeout = 1.5, HANG_CALL_TIMEOUT_S
    output, _ = await h.run(
        WALK, max_attempts=1, episode_deadline_s=deadline, environment={"call_timeout_s": call_timeout}
    )

    # Bounded by the deadline plus one per-call timeout (with a loaded machine's slack), and blamed on the environment.
    assert time.monotonic() - started < deadline + call_timeout + 4.0
    assert output.extra_fields["env_invalid"] is True
    assert output.extra_fields["env_failure_kind"] == "timeout"
    assert output.extra_fields["deadline_hit"] is False
    assert h.all_closed()


HOLD_LIMIT_S = 3.5


async def test_a_session_held_open_past_its_hold_limit_by_a_held_generation_is_an_infrastructure_timeout(h):
    loop, policy = held_loop(
        h,
        WALK,
        held_turn=1,
        hold_s=30.0,
        max_attempts=2,
        # Seconds, not tenths: on a loaded machine the observe before the held turn must fit in the deadline.
        episode_deadline_s=1.5,
        session_hold_limit_s=HOLD_LIMIT_S,
        environment={"call_timeout_s": 1.5},
    )
    started = time.monotonic()

    output = await loop.run(SAMPLING, **make_row(task="Open the About page", verifier_metadata=ABOUT))

    # Each attempt gave its browser back at the hold limit; the trainer's hold is never a policy zero.
    assert time.monotonic() - started < 2 * HOLD_LIMIT_S + 3
    assert flags(output) == {
        "env_invalid": True,
        "env_failure_kind": "timeout",
        "env_attempts": 2,
        "deadline_hit": False,
        "reward_source": None,
    }
    assert "held open" in output.extra_fields["env_failure_reason"]
    assert output.extra_fields["env_failed_attempt_kinds"] == ["timeout", "timeout"]
    # The held generation was cancelled, not abandoned to run on for nobody.
    assert policy.cancelled == 2
    assert len(h.server.session_ids) == 2 and h.all_closed()
    assert h.server.events(h.server.session_ids[0]) == ["seed", "observe", "close"]


def test_the_hold_limit_must_leave_room_for_the_deadline_and_one_call():
    environment = {"server_urls": ["http://127.0.0.1:1"], "call_timeout_s": 10}
    with pytest.raises(ValueError, match="session_hold_limit_s=65 must be at least"):
        BrowserLoopSettings.from_mapping(
            {"environment": environment, "episode_deadline_s": 60, "session_hold_limit_s": 65}
        )
    settings = BrowserLoopSettings.from_mapping(
        {"environment": environment, "episode_deadline_s": 60, "session_hold_limit_s": 70}
    )
    assert settings.session_hold_limit_s == 70


# ----- policy outcomes stay valid -----------------------------------------------------------------------------


async def test_a_policy_that_ends_on_its_first_token_is_a_valid_zero(h):
    output, policy = await h.run(sp.say(""))

    assert policy.calls == 1
    assert output.response_mask == [1]  # just the end-of-turn token: short, and still the policy's own
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 1}
    assert output.reward_score == 0.0
    assert h.server.events(h.server.session_ids[0]) == ["seed", "verify", "close"]


async def test_invalid_arguments_unknown_actions_and_bad_element_ids_are_told_to_the_model(h):
    script = sp.steps(
        sp.say('<tool_call>\n{"name": "browser", "arguments": {action: observe}}\n</tool_call>'),
        sp.say(sp.tool_call("browser", {"action": "fly"})),
        sp.say(sp.tool_call("browser", {"action": "click"})),
        sp.observe(),
        sp.say(sp.tool_call("browser", {"action": "click", "element_id": 9999})),
        sp.say(sp.tool_call("teleport", {"to": "moon"})),
        sp.say(sp.tool_call("browser", json.dumps(json.dumps({"action": "observe"})))),
        sp.click_matching("About"),
        sp.finish("ALPHA-42"),
    )

    output, policy = await h.run(script)

    text = h.text(output)
    assert "Invalid JSON in arguments for 'browser'" in text
    assert "unknown action 'fly'" in text
    assert "click needs an element_id" in text
    assert "Error: click failed" in text and "9999" in text
    assert "Unknown function 'teleport'" in text
    assert policy.calls == 9
    assert output.reward_score == 1.0
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 1}
    assert h.server.events(h.server.session_ids[0]) == [
        "seed", "observe", "click", "observe", "click", "finish", "verify", "close"
    ]  # fmt: skip


async def test_native_tool_arguments_the_server_rejects_come_back_as_its_validation_message(h):
    script = sp.steps(
        sp.observe(use_native=True),
        sp.say(sp.native("click", elementId=1)),
        sp.finish("x", use_native=True),
    )

    output, _ = await h.run(
        script, tools=load_tools(native=True), trainer_config=compose_trainer_config(native_tools=True)
    )

    assert "invalid arguments for browser_click: element_id: Field required" in h.text(output)
    assert output.extra_fields["env_invalid"] is False


async def test_policy_navigation_to_local_addresses_and_non_web_schemes_is_refused_without_reaching_the_browser(h):
    refused = [
        "http://169.254.169.254/latest/meta-data/",
        f"http://2130706433:{h.server.port}/",
        "http://[::ffff:127.0.0.1]/",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "chrome://settings",
        "http://localhost/",
    ]
    script = sp.steps(*(sp.navigate(url) for url in refused), sp.observe(), sp.click_matching("About"), sp.finish("x"))

    output, _ = await h.run(script)

    text = h.text(output)
    assert text.count("Error: navigation refused") == len(refused)
    assert "link-local (cloud metadata)" in text and "the file: scheme is not allowed" in text
    assert h.server.calls("browser_navigate") == 0
    assert output.extra_fields["env_refused_navigations"] == len(refused)
    assert flags(output) == {**VALID_VERIFY, "env_attempts": 1}
    assert output.reward_score == 1.0


async def test_the_start_page_and_the_allow_list_are_honoured_for_navigation(h):
    other = f"http://127.0.0.1:{_dead_port()}/page.html"
    script = sp.steps(sp.observe(), sp.navigate(other), sp.navigate(ABOUT_URL), sp.finish("x"))

    output, _ = await h.run(script, url_policy={"allowlist": [other.rsplit("/", 1)[0]]})

    # Both navigations reached the browser: the allow-listed one failed to load (a policy error), the
    # start page's sibling loaded and the verifier graded it.
    assert h.server.calls("browser_navigate") == 2
    assert "Error: navigate failed" in h.text(output)
    assert output.reward_score == 1.0 and output.extra_fields["env_refused_navigations"] == 0


async def test_an_http_start_url_allows_its_origin_and_nothing_else_on_loopback(h):
    from nemo_gym_browser.local.environment_server.site_model import Page, Site, link

    site = Site({"http://127.0.0.1:8123/a.html": Page(title="A", text="a", elements=(link("B", "b.html"),))})
    site = site.with_pages({"http://127.0.0.1:8123/b.html": Page(title="B", text="b")})
    async with InProcessEnvironmentServer(site) as own:
        row = make_row(
            task="go", initial_url="http://127.0.0.1:8123/a.html", verifier_metadata={"url_contains": "b.html"}
        )
        script = sp.steps(
            sp.navigate("http://127.0.0.1:8124/b.html"), sp.navigate("http://127.0.0.1:8123/b.html"), sp.finish("b")
        )
        output, _ = await h.run(script, row=row, urls=[own.url])

    assert h.text(output).count("Error: navigation refused") == 1
    assert own.calls("browser_navigate") == 1 and output.reward_score == 1.0


# ----- nothing leaks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["generation", "browser-call"])
async def test_a_cancelled_rollout_closes_its_session(h, where):
    if where == "browser-call":
        h.server.set_latency(30.0, "browser_click")
        loop, _ = h.loop(WALK)
    else:
        loop, _ = h.loop(WALK, think_time_s=lambda view: 30.0 if view.turn == 1 else 0.0)
    task = asyncio.create_task(loop.run(SAMPLING, **make_row(task="Open the About page", verifier_metadata=ABOUT)))
    for _ in range(1000):  # up to 10 s or more on a loaded machine; a few tenths otherwise
        await asyncio.sleep(0.01)
        if h.server.session_ids and "observe" in h.server.events(h.server.session_ids[0]):
            break
    await asyncio.sleep(0.05)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert h.server.open_sessions == 0
    assert h.server.events(h.server.session_ids[0])[-1] == "close"
