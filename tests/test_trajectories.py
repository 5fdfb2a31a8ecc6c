"""Trajectories a person can read: the records the real loop writes against the fake server, and the page over them.

The writer runs inside ``BrowserToolAgentLoop`` built from ``configs/agent_loop.yaml`` on verl 0.9.1's real
``ToolAgentLoop`` with a scripted policy (as in ``test_agent_loop.py``). The renderer is checked on records and an
advantage log in the V1 trainer's format, against a hand-computed GRPO group; the integration test opens the page
in Debian's headless Chromium.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from pathlib import Path

import pytest

from nemo_gym_browser import trajectories as tj
from nemo_gym_browser import trajectory_page as tp
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.in_process_loop import build_loop, make_row
from nemo_gym_browser.testing import stepwise_policy as swp

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
def rollout(server, tokenizer, tools, stepwise_trainer_config):
    async def run(script, *, extra=None, row=None, **settings):
        settings.setdefault("resample_backoff_s", 0)
        loop = build_loop(
            sp.ScriptedPolicy(tokenizer, script),
            tokenizer=tokenizer,
            tools=tools,
            trainer_config=stepwise_trainer_config,
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
    assert record["steps"][1]["arguments"] == {"element_id": 1} and record["steps"][1]["outcome"] == "ok"
    times = [step["at_s"] for step in record["steps"]]
    assert times == sorted(times) and times[0] >= 0
    assert record["final_answer"] == "ALPHA-42"
    assert "ALPHA-42" in record["last_model_turn"] and "finish" in record["last_model_turn"]
    assert "about.html" in record["last_page"]["url"]
    assert record["episode_id"].startswith("r0-")


async def test_a_rollout_that_failed_then_recovered_records_its_failed_attempt_kinds(rollout, server, tmp_path):
    server.inject("browser_click", Fault.status(503), on_call=1)

    # No resume, so the rollout is run again (a resumed episode's record: tests/test_resume.py).
    await rollout(WALK, trajectory_dir=str(tmp_path), resume={"max_per_episode": 0})

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


async def test_concurrent_rollouts_of_one_process_append_whole_lines_to_one_file(rollout, tmp_path):
    rows = [make_row(task="Open the About page", verifier_metadata=ABOUT, index=i) for i in range(4)]

    await asyncio.gather(*(rollout(WALK, row=row, trajectory_dir=str(tmp_path)) for row in rows))

    (path,) = tmp_path.rglob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["index"] for r in records) == [0, 1, 2, 3]
    assert len({r["episode_id"] for r in records}) == 4


def _write_many(folder: str, worker: int, count: int) -> None:
    for number in range(count):
        tj.write_record(folder, {"episode_id": f"w{worker}-{number}", "global_steps": 5, "pad": "x" * 20_000})


def test_worker_processes_write_separate_files_and_no_line_is_torn(tmp_path):
    context = multiprocessing.get_context("fork")  # a worker process of its own pid, quickly
    workers = [context.Process(target=_write_many, args=(str(tmp_path), worker, 50)) for worker in range(2)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=60)
        assert process.exitcode == 0

    files = sorted((tmp_path / "step-000005").glob("*.jsonl"))
    assert len(files) == 2  # one per process
    for path in files:
        ids = [json.loads(line)["episode_id"] for line in path.read_text().splitlines()]
        assert len(ids) == 50 and len({i.split("-")[0] for i in ids}) == 1


async def test_a_stepwise_episode_is_one_record_with_every_step_and_the_final_samples_turn(rollout, tmp_path):
    stepwise = {"enabled": True, "history_observations": 1, "history_steps": 10}

    script = swp.steps(sp.observe(), sp.click_matching("About"), sp.finish("ALPHA-42"))  # reads the step history

    outputs = await rollout(script, stepwise=stepwise, trajectory_dir=str(tmp_path), extra=V1_KWARGS)

    assert isinstance(outputs, list) and len(outputs) == 3  # one sample per policy step
    (record,) = records_in(tmp_path)
    assert [step["action"] for step in record["steps"]] == ["observe", "click", "finish"]
    assert record["reward"] == 1.0 and "ALPHA-42" in record["last_model_turn"]


def test_a_stepwise_episodes_recipe_advantage_is_its_final_samples(tmp_path):
    samples = [
        {"key": f"u1_0_{index}", "uid": "u1", "env_invalid": False, "score": 1.0, "advantage": 0.1 * index}
        for index in (2, 10, 9)
    ]
    log = tmp_path / "advantages.jsonl"
    log.write_text(json.dumps({"step": 1, "samples": samples}) + "\n")

    (entry,) = tp.load_advantage_log(log).items()

    assert entry[0] == "u1_0" and entry[1].advantage == pytest.approx(1.0) and entry[1].samples == 3


async def test_nothing_is_written_when_trajectory_dir_is_null(rollout, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    await rollout(WALK, trajectory_dir=None)

    assert list(tmp_path.rglob("*")) == []


async def test_a_script_tag_in_the_policys_answer_reaches_the_page_as_text(rollout, tmp_path):
    answer = "<script>document.title='owned'</script>"
    await rollout(sp.steps(sp.observe(), sp.finish(answer)), trajectory_dir=str(tmp_path / "records"))

    (record,) = records_in(tmp_path / "records")
    assert record["final_answer"] == answer  # the record keeps the policy's text as it was
    page = tmp_path / "page.html"
    assert tp.main([str(tmp_path / "records"), "--html", str(page)]) == 0
    text = page.read_text()
    assert "<script" not in text
    assert "&lt;script&gt;document.title=&#x27;owned&#x27;&lt;/script&gt;" in text


def test_credentials_in_urls_are_redacted_and_search_terms_kept():
    url = "https://user:pw@shop.example/search?q=red+shoes&access_token=abc123&page=2#top"

    redacted = tj.redact_url(url)

    assert "abc123" not in redacted and "user:pw" not in redacted
    assert "q=red+shoes" in redacted and "page=2" in redacted and f"access_token={tj.REDACTED}" in redacted
    assert tj.redact_text(f"navigate(url='{url}') -> ok").count("abc123") == 0
    assert tj.redact_url("https://shop.example/item/7?q=x") == "https://shop.example/item/7?q=x"


# ----- the page: groups side by side, both advantages ----------------------------------------------------------


def record(uid, session, reward, *, step=3, invalid=False, kind=None, answer="42", task="shop--price"):
    return {
        "version": tj.RECORD_VERSION,
        "episode_id": f"r0-{uid}-{session}",
        "task_id": task,
        "question": "What does the red kettle cost?",
        "start_url": "http://127.0.0.1:8000/index.html",
        "global_steps": step,
        "uid": uid,
        "session_id": session,
        "reward": reward,
        "flags": {
            "env_invalid": invalid,
            "env_failure_kind": kind,
            "env_failure_reason": f"session s{session} lost" if invalid else None,
            "attempts": 3 if invalid else 1,
            "deadline_hit": False,
            "reward_source": None if invalid else "verify",
        },
        "failed_attempt_kinds": [kind] * 3 if invalid else [],
        "steps": [{"index": 0, "action": "observe", "arguments": "", "result": "ok", "at_s": 0.4}],
        "final_answer": answer,
        "last_page": {"url": "http://127.0.0.1:8000/kettle.html", "title": "Red kettle", "text": "Price 42"},
    }


# Group "a", hand-computed. Rewards 1, 0, 0 (invalid), 0 (invalid).
#   stock GRPO: mean 0.25, unbiased std sqrt((0.75² + 3 × 0.25²) / 3) = 0.5 → +1.5, -0.5, -0.5, -0.5
#   recipe (grpo_env_aware over the valid two): mean 0.5, std sqrt(0.5) → +0.707, -0.707; invalid ones 0
GROUP_A = [
    record("a", 0, 1.0),
    record("a", 1, 0.0),
    record("a", 2, 0.0, invalid=True, kind="session_lost"),
    record("a", 3, 0.0, invalid=True, kind="session_lost"),
]
LOG_A = {0: (1.0, 0.7071), 1: (0.0, -0.7071), 2: (0.0, 0.0), 3: (0.0, 0.0)}


def write_run(folder: Path, records: list[dict], log: dict[str, tuple[float, float]] | None = None) -> Path:
    for item in records:
        path = folder / "records" / f"step-{item['global_steps']:06d}" / "host-1.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(json.dumps(item) + "\n")
    samples = [
        {"key": f"{key}_0", "uid": key.split("_")[0], "env_invalid": None, "score": score, "advantage": advantage}
        for key, (score, advantage) in (log or {}).items()
    ]
    (folder / "advantages.jsonl").write_text(json.dumps({"step": 3, "samples": samples}) + "\n")
    return folder / "records"


def test_stock_grpo_is_computed_plainly_from_the_group_with_failures_as_zeros():
    assert tp.stock_grpo_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert tp.stock_grpo_advantages([1.0]) == pytest.approx([1.0], abs=1e-5)  # verl: a group of one, mean 0, std 1
    assert tp.stock_grpo_advantages([1.0, 1.0]) == [0.0, 0.0]


def test_the_page_shows_each_group_side_by_side_with_the_recipes_and_stock_grpos_advantages(tmp_path):
    group_b = [record("b", 0, 1.0, task="shop--open"), record("b", 1, 1.0, task="shop--open")]
    later = [record("c", 0, 0.0, step=4), record("c", 1, 1.0, step=4)]
    log = {f"a_{s}": LOG_A[s] for s in range(4)} | {"b_0": (1.0, 0.0), "b_1": (1.0, 0.0)}
    records_dir = write_run(tmp_path, GROUP_A + group_b + later, log)

    page = tmp_path / "page.html"
    status = tp.main([str(records_dir), "--advantages", str(tmp_path / "advantages.jsonl"), "--html", str(page)])

    assert status == 0
    text = page.read_text()
    assert text.count('<section class="step"') == 2 and 'id="step-3"' in text and 'id="step-4"' in text
    assert text.count('<div class="group"') == 3
    group_a = text.split('data-group="uid a"')[1].split('<div class="group"')[0]
    recipe = [float(v) for v in _cells(group_a, "adv-recipe")]
    stock = [float(v) for v in _cells(group_a, "adv-stock")]
    assert recipe == [0.707, -0.707, 0.0, 0.0]
    assert stock == [1.5, -0.5, -0.5, -0.5]
    assert group_a.count('<article class="episode invalid"') == 2 and "invalid: session_lost" in group_a
    group_c = text.split('data-group="uid c"')[1]
    assert _cells(group_c, "adv-recipe") == ["n/a", "n/a"]  # not in the log: shown as missing, never as 0
    assert [float(v) for v in _cells(group_c, "adv-stock")] == [-0.707, 0.707]


def _cells(fragment: str, name: str) -> list[str]:
    import re

    return re.findall(rf'<td class="{name} [a-z]+">([^<]*)</td>', fragment)


def test_a_log_whose_scores_disagree_with_the_records_fails_the_check_but_the_page_is_written(tmp_path, capsys):
    records_dir = write_run(tmp_path, GROUP_A, {"a_0": (0.0, 0.0), "a_1": (0.0, 0.0)})
    page = tmp_path / "page.html"

    assert tp.main([str(records_dir), "--advantages", str(tmp_path / "advantages.jsonl"), "--html", str(page)]) == 1

    assert page.exists()
    assert "reward 1 in its record, score 0 in the advantage log" in capsys.readouterr().err


def test_bad_input_is_a_usage_error_with_the_file_and_line_and_nothing_is_written(tmp_path, capsys):
    records_dir = write_run(tmp_path, GROUP_A[:1])
    (records_dir / "step-000003" / "host-1.jsonl").open("a").write("{not json\n")
    page = tmp_path / "page.html"

    assert tp.main([str(records_dir), "--html", str(page)]) == 2
    assert "host-1.jsonl:2: not a JSON line" in capsys.readouterr().err
    assert tp.main([str(tmp_path / "missing"), "--html", str(page)]) == 2
    assert "not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert tp.main([str(tmp_path / "empty"), "--html", str(page)]) == 2
    assert "no trajectory records" in capsys.readouterr().err
    (tmp_path / "bad-log.jsonl").write_text('{"step": 1, "samples": [{"key": "a_0_0"}]}\n')
    assert tp.main([str(records_dir.parent / "empty"), "--html", str(page)]) == 2
    good = write_run(tmp_path / "good", GROUP_A[:1])
    assert tp.main([str(good), "--advantages", str(tmp_path / "bad-log.jsonl"), "--html", str(page)]) == 2
    assert "bad-log.jsonl:1: not an advantage-log line" in capsys.readouterr().err
    assert not page.exists()


def test_help_explains_the_inputs_and_exit_statuses(capsys):
    with pytest.raises(SystemExit) as stop:
        tp.main(["--help"])

    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "--advantages" in text and "NEMO_GYM_BROWSER_ADVANTAGE_LOG" in text and "exit status" in text
    with pytest.raises(SystemExit) as stop:
        tp.main([])
    assert stop.value.code == 2


def test_the_page_command_runs_as_python_dash_m_nemo_gym_browser_trajectories(tmp_path):
    import subprocess
    import sys

    records_dir = write_run(tmp_path, GROUP_A[:1])
    page = tmp_path / "page.html"
    completed = subprocess.run(
        [sys.executable, "-m", "nemo_gym_browser.trajectories", str(records_dir), "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert completed.returncode == 0, completed.stderr
    assert "1 episodes, 1 groups" in completed.stdout and page.read_text().startswith("<!DOCTYPE html>")


# ----- the page in a real browser -----------------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_TIMEOUT_S = 60.0


def chromium(page: Path, profile: Path, *arguments: str) -> bytes:
    """Debian's headless Chromium on a file:// page; its whole process group is stopped whatever happens."""
    import os
    import signal
    import subprocess

    process = subprocess.Popen(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--window-size=1400,1000",
            *arguments,
            page.as_uri(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=CHROMIUM_TIMEOUT_S)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, f"chromium exited {process.returncode}"
    return out


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.integration
def test_headless_chromium_renders_the_groups_side_by_side_with_both_advantages_and_runs_no_policy_script(tmp_path):
    hostile = record("a", 1, 0.0, answer="<script>document.title='owned'</script>")
    group_b = [record("b", 0, 1.0, task="shop--open"), record("b", 1, 0.0, task="shop--open")]
    log = {f"a_{s}": LOG_A[s] for s in range(4)} | {"b_0": (1.0, 0.7071), "b_1": (0.0, -0.7071)}
    records_dir = write_run(tmp_path, [GROUP_A[0], hostile, *GROUP_A[2:], *group_b], log)
    page = tmp_path / "page.html"
    assert tp.main([str(records_dir), "--advantages", str(tmp_path / "advantages.jsonl"), "--html", str(page)]) == 0

    shot = tmp_path / "page.png"
    chromium(page, tmp_path / "profile-shot", f"--screenshot={shot}")
    dom = chromium(page, tmp_path / "profile-dom", "--dump-dom").decode()

    width, height = png_size(shot.read_bytes())
    assert (width, height) == (1400, 1000) and shot.stat().st_size > 20_000  # drawn, not a blank page
    assert "<title>Trajectories</title>" in dom  # the policy's script never ran (it would have renamed the page)
    assert "<script" not in dom and "&lt;script&gt;document.title" in dom
    assert dom.count('class="group"') == 2 and dom.count('<article class="episode') == 6
    group_a = dom.split('data-group="uid a"')[1].split('data-group="uid b"')[0]
    assert [float(v) for v in _cells(group_a, "adv-recipe")] == [0.707, -0.707, 0.0, 0.0]
    assert [float(v) for v in _cells(group_a, "adv-stock")] == [1.5, -0.5, -0.5, -0.5]
