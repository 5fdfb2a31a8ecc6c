"""Trajectories a person can read: the records the real loop writes against the fake server, and the page over them.

The writer runs inside ``BrowserToolAgentLoop`` built from ``configs/agent_loop.yaml`` on verl 0.9.1's real
``ToolAgentLoop`` with a scripted policy (as in ``test_agent_loop.py``). The renderer is checked on records and an
advantage log in the V1 trainer's format, against a hand-computed GRPO group; the integration test opens the page
in Debian's headless Chromium.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_gym_browser import trajectories as tj
from nemo_gym_browser.testing import scripted_policy as sp
from nemo_gym_browser.testing.agent_loop_harness import build_loop, make_row
from nemo_gym_browser.testing.fake_environment import Fault

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
ABOUT = {"url_contains": "about.html"}
WALK = sp.walk_and_finish("About", "ALPHA-42")
FAST_ENV = {
    "call_timeout_s": 2.0,
    "seed_timeout_s": 2.0,
    "verify_timeout_s": 2.0,
    "close_timeout_s": 2.0,
    "retry_backoff_s": 0.01,
    "server_cooldown_s": 0.5,
}
V1_KWARGS = {"uid": "group-a", "session_id": 1, "global_steps": 7}


def records_in(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.rglob("*.jsonl")) for line in path.read_text().splitlines()]


@pytest.fixture
def rollout(server, tokenizer, tools, trainer_config):
    async def run(script, *, extra=None, row=None, **settings):
        settings.setdefault("resample_backoff_s", 0)
        loop = build_loop(
            sp.ScriptedPolicy(tokenizer, script),
            tokenizer=tokenizer,
            tools=tools,
            trainer_config=trainer_config,
            environment={"server_urls": [server.url], **FAST_ENV},
            **settings,
        )
        row = row if row is not None else make_row(task="Open the About page", verifier_metadata=ABOUT)
        return await loop.run(SAMPLING, **row, **(extra or {}))

    return run


# ----- the writer, through the real loop --------------------------------------------------------------------------


async def test_each_rollout_writes_one_record_with_its_steps_flags_reward_and_verl_ids(rollout, tmp_path):
    output = await rollout(WALK, trajectory_dir=str(tmp_path), extra=V1_KWARGS)

    (record,) = records_in(tmp_path)
    (path,) = tmp_path.rglob("*.jsonl")
    assert path.parent.name == "step-000007"  # one folder per training step, one file per process
    assert record["reward"] == output.reward_score == 1.0
    assert (record["uid"], record["session_id"], record["global_steps"]) == ("group-a", 1, 7)
    assert record["task_id"] == "task-1" and record["question"] == "Open the About page"
    assert record["flags"] == {
        "env_invalid": False,
        "env_failure_kind": None,
        "env_failure_reason": None,
        "attempts": 1,
        "deadline_hit": False,
        "reward_source": "verify",
    }
    assert record["failed_attempt_kinds"] == []
    assert [step["action"] for step in record["steps"]] == ["observe", "click", "finish"]
    assert record["steps"][1]["arguments"] == "element_id=1" and record["steps"][1]["result"] == "ok"
    times = [step["at_s"] for step in record["steps"]]
    assert times == sorted(times) and times[0] >= 0
    assert record["final_answer"] == "ALPHA-42"
    assert "about.html" in record["last_page"]["url"]
    assert record["episode_id"].startswith("r0-")


async def test_a_rollout_that_failed_then_recovered_records_its_failed_attempt_kinds(rollout, server, tmp_path):
    server.inject("browser_click", Fault.status(503), on_call=1)

    await rollout(WALK, trajectory_dir=str(tmp_path))

    (record,) = records_in(tmp_path)
    assert record["failed_attempt_kinds"] == ["server_error"]
    assert record["flags"]["attempts"] == 2 and record["flags"]["env_invalid"] is False
    # The final attempt's steps only: the failed attempt's observe/click are not mixed in.
    assert [step["action"] for step in record["steps"]] == ["observe", "click", "finish"]
    assert next(tmp_path.rglob("*.jsonl")).parent.name == tj.UNKNOWN_STEP_DIR  # no trainer step outside verl


async def test_an_exhausted_rollout_is_recorded_invalid_with_its_kind_and_reason(rollout, server, tmp_path):
    server.inject("seed_session", Fault.fail_seed())

    await rollout(WALK, trajectory_dir=str(tmp_path), max_attempts=2)

    (record,) = records_in(tmp_path)
    assert record["flags"]["env_invalid"] is True and record["flags"]["env_failure_kind"] == "seed_failed"
    assert record["flags"]["env_failure_reason"]
    assert record["failed_attempt_kinds"] == ["seed_failed", "seed_failed"]
    assert record["steps"] == [] and record["reward"] == 0.0


async def test_nothing_is_written_when_trajectory_dir_is_null(rollout, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    await rollout(WALK, trajectory_dir=None)

    assert list(tmp_path.rglob("*")) == []
