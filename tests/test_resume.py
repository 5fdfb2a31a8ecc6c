"""Resume, don't resample: a session lost under a browser call (or verify) is repaired in a new session where the
policy's calls so far are replayed and checked, and the same sample goes on; a replay that reaches another page, or
a spent budget, falls back to re-running the rollout.

Each test runs verl 0.9.1's real agent-loop machinery (``configs/agent_loop.yaml``, its tool path and token builder),
a scripted policy and the in-process environment server, in both sample modes; the faults are the server's own.
"""

from __future__ import annotations

import json

import pytest

from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.in_process_loop import build_loop, make_row
from nemo_gym_browser.trainer_side.episode_metrics import episode_metrics
from nemo_gym_browser.trajectory_page import build_groups, render_page

SAMPLING = {"temperature": 1.0, "logprobs": True}
ABOUT = {"url_contains": "about.html"}
V1_KWARGS = {"uid": "u1", "session_id": 0, "global_steps": 3}
# Seconds that hold on a loaded machine: no call here is meant to time out.
ENVIRONMENT = {"call_timeout_s": 30.0, "seed_timeout_s": 30.0, "verify_timeout_s": 30.0, "retry_backoff_s": 0.01}
WALK = sp.walk_and_finish("About", "x")
MODES = ["trajectory", "stepwise"]


@pytest.fixture
def run(server, tokenizer, tools, trainer_config, stepwise_trainer_config):
    async def run(mode: str, **settings):
        settings.setdefault("resample_backoff_s", 0)
        policy = sp.ScriptedPolicy(tokenizer, {"walk": WALK})
        loop = build_loop(
            policy,
            tokenizer=tokenizer,
            tools=tools,
            trainer_config=stepwise_trainer_config if mode == "stepwise" else trainer_config,
            environment={"server_urls": [server.url], **ENVIRONMENT},
            stepwise={"enabled": mode == "stepwise"},
            **settings,
        )
        row = make_row(task="walk to About", verifier_metadata=ABOUT)
        outputs = await loop.run(SAMPLING, **row, **V1_KWARGS)
        await close_shared_clients()
        return (outputs if isinstance(outputs, list) else [outputs]), policy

    return run


def samples(outputs) -> list[tuple[list[int], list[int], list[int], float]]:
    """What the trainer gets of each sample: its prompt, its response, which tokens are the policy's, its reward."""
    return [(o.prompt_ids, o.response_ids, o.response_mask, o.reward_score) for o in outputs]


def records(folder) -> list[dict]:
    """The trajectory records written under ``folder``."""
    return [json.loads(line) for path in folder.rglob("*.jsonl") for line in path.read_text().splitlines()]


def flags(outputs) -> dict:
    return outputs[-1].extra_fields


@pytest.mark.parametrize("mode", MODES)
async def test_a_session_lost_under_the_second_call_is_resumed_and_the_samples_are_those_of_an_unbroken_episode(
    run, server, mode
):
    clean, clean_policy = await run(mode)
    server.inject("browser_click", Fault.lose_session(), on_call=1)
    resumed, policy = await run(mode)

    assert samples(resumed) == samples(clean) and clean[-1].reward_score == 1.0
    assert policy.calls == clean_policy.calls == 3  # the model was never asked again
    assert flags(resumed)["env_attempts"] == 1 and flags(resumed)["env_failed_attempt_kinds"] == []
    assert flags(resumed)["env_resumed_kinds"] == ["session_lost"] and flags(resumed)["env_resume_diverged"] == 0
    lost, repaired = server.session_ids[-2:]
    assert server.events(lost) == ["seed", "observe", "click", "close"]
    # The new session: the observe replayed, the click made again, then the episode's own calls.
    assert server.events(repaired) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert server.open_sessions == 0


async def test_a_replay_that_reaches_another_page_is_given_up_and_the_rollout_is_run_again(run, server):
    server.inject("browser_click", Fault.lose_session(), on_call=1)
    other_page = "URL: http://127.0.0.1/elsewhere.html\nTITLE: Elsewhere\nELEMENTS:\n  [0] a: About"
    server.inject("browser_observe", Fault.respond({"observation": other_page}), on_call=2)  # the replayed one
    outputs, policy = await run("trajectory")

    assert flags(outputs)["env_resume_diverged"] == 1 and flags(outputs)["env_resumed_kinds"] == []
    assert flags(outputs)["env_attempts"] == 2 and flags(outputs)["env_failed_after_action_kinds"] == ["session_lost"]
    assert outputs[-1].reward_score == 1.0 and policy.calls == 2 + 3  # the first attempt's two turns, then three
    assert server.open_sessions == 0


async def test_a_call_failing_past_its_resume_budget_fails_the_attempt_and_the_rollout_is_run_again(run, server):
    server.inject("browser_click", Fault.lose_session(), on_call=1, times=3)
    outputs, policy = await run("trajectory", resume={"max_per_call": 2, "max_per_episode": 4})

    assert flags(outputs)["env_resumed_kinds"] == ["session_lost", "session_lost"]
    assert flags(outputs)["env_failed_attempt_kinds"] == ["session_lost"] and flags(outputs)["env_attempts"] == 2
    assert outputs[-1].reward_score == 1.0 and policy.calls == 2 + 3
    assert server.open_sessions == 0


async def test_a_new_session_that_fails_to_open_is_tried_again_within_the_budget(run, server, tmp_path):
    server.inject("browser_click", Fault.lose_session(), on_call=1)
    server.inject("seed_session", Fault.fail_seed(), on_call=2)  # the first resume's seed
    outputs, policy = await run("trajectory", trajectory_dir=str(tmp_path))

    assert outputs[-1].reward_score == 1.0 and policy.calls == 3 and flags(outputs)["env_attempts"] == 1
    assert flags(outputs)["env_resumed_kinds"] == ["session_lost"]
    (record,) = records(tmp_path)
    assert [r["outcome"] for r in record["resumes"]] == ["failed", "resumed"]
    assert record["resumes"][0]["detail"].startswith("seed_failed")
    assert server.open_sessions == 0


async def test_the_episode_budget_bounds_resumes_across_calls(run, server):
    server.inject("browser_observe", Fault.lose_session(), on_call=1)
    server.inject("browser_click", Fault.lose_session(), on_call=1)
    outputs, _ = await run("trajectory", resume={"max_per_call": 2, "max_per_episode": 1}, max_attempts=1)

    assert flags(outputs)["env_resumed_kinds"] == ["session_lost"]
    assert flags(outputs)["env_invalid"] is True and flags(outputs)["env_failure_kind"] == "session_lost"


async def test_with_no_resume_budget_a_lost_session_re_runs_the_rollout(run, server):
    server.inject("browser_click", Fault.lose_session(), on_call=1)
    outputs, policy = await run("trajectory", resume={"max_per_episode": 0})

    assert flags(outputs)["env_resumed_kinds"] == [] and flags(outputs)["env_attempts"] == 2
    assert policy.calls == 2 + 3


async def test_a_session_lost_under_verify_is_resumed_and_graded_in_the_new_session(run, server):
    server.inject("verify", Fault.lose_session(), on_call=1)
    outputs, policy = await run("trajectory")

    assert outputs[-1].reward_score == 1.0 and flags(outputs)["env_attempts"] == 1 and policy.calls == 3
    assert flags(outputs)["env_resumed_kinds"] == ["session_lost"]
    assert server.events(server.session_ids[-1]) == ["seed", "observe", "click", "finish", "verify", "close"]


async def test_a_grade_the_server_refused_is_not_resumed(run, server):
    server.inject("verify", Fault.respond({"reward": 1.0, "mask_sample": True}), on_call=1)
    outputs, _ = await run("trajectory", max_attempts=1)

    assert flags(outputs)["env_failure_kind"] == "verify_unavailable" and flags(outputs)["env_resumed_kinds"] == []
    assert len(server.session_ids) == 1


async def test_the_record_and_the_page_show_where_an_episode_was_resumed(run, server, tmp_path):
    server.inject("browser_click", Fault.lose_session(), on_call=1)
    await run("trajectory", trajectory_dir=str(tmp_path))

    (record,) = records(tmp_path)
    (resume,) = record["resumes"]
    assert resume["after_steps"] == 1 and resume["kind"] == "session_lost" and resume["outcome"] == "resumed"
    assert resume["replayed_calls"] == 1 and resume["seconds"] >= 0
    assert record["resumed_kinds"] == ["session_lost"] and [s["action"] for s in record["steps"]] == [
        "observe",
        "click",
        "finish",
    ]
    page = render_page(build_groups([record]), source=str(tmp_path), advantage_log=None)
    assert "resumed after: session_lost" in page and "session_lost, resumed: 1 call(s) replayed" in page


def test_step_metrics_count_resumes_diverged_replays_and_re_runs_after_an_action():
    def sample(**extra):
        return {"env_invalid": False, "env_attempts": 1, **extra}

    rows = [
        sample(env_resumed_kinds=["session_lost", "timeout"]),
        sample(
            env_resume_diverged=1,
            env_attempts=2,
            env_failed_attempt_kinds=["session_lost"],
            env_failed_after_action_kinds=["session_lost"],
        ),
        sample(),
        sample(),
    ]
    metrics = episode_metrics(rows)
    assert metrics["env/resumed_rate"] == 0.25 and metrics["env/resumes/mean"] == 0.5
    assert metrics["env/resume_diverged_rate"] == 0.25 and metrics["env/rerun_after_action_rate"] == 0.25
    assert metrics["env/resumed/session_lost"] == 1.0 and metrics["env/resumed/timeout"] == 1.0
