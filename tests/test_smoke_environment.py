"""``python smoke_environment.py``: exit codes and diagnoses, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.faults.kinds import Fault

SCRIPT = Path(__file__).resolve().parents[1] / "smoke_environment.py"


def smoke(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def fake():
    with InProcessEnvironmentServer().run_in_thread() as env:
        yield env


def test_the_bundled_episode_walks_verifies_reward_one_and_releases_the_session(fake):
    done = smoke("--url", fake.url)
    assert done.returncode == 0, done.stdout + done.stderr
    for step in ("seed", "observe", "click", "finish", "verify", "close", "released"):
        assert f". {step}" in done.stdout
    assert "reward=1.0" in done.stdout
    assert "OK: episode walked and verified, reward 1.0" in done.stdout
    assert fake.server.open_sessions == 0
    session = fake.server.session_ids[0]
    assert fake.server.events(session)[:6] == ["seed", "observe", "click", "finish", "verify", "close"]


def test_a_stopped_server_exits_one_within_its_timeouts_with_a_diagnosis(fake):
    fake.stop_server()
    started = time.monotonic()
    done = smoke("--url", fake.url, "--timeout", "5")
    assert done.returncode == 1
    assert time.monotonic() - started < 30
    assert "FAIL (unreachable)" in done.stdout
    assert "not reachable" in done.stdout


def test_a_session_cookie_that_does_not_round_trip_is_diagnosed(fake):
    fake.server.inject("browser_observe", Fault.lose_session())
    done = smoke("--url", fake.url)
    assert done.returncode == 1
    assert "FAIL (session_lost)" in done.stdout
    assert "cookie" in done.stdout


def test_a_rejected_seed_schema_is_diagnosed(fake):
    fake.server.inject("seed_session", Fault.status(422, {"detail": [{"loc": ["body", "x"], "msg": "Extra inputs"}]}))
    done = smoke("--url", fake.url)
    assert done.returncode == 1
    assert "FAIL (seed_failed)" in done.stdout and "422" in done.stdout
    assert "rejected the seed request" in done.stdout


def test_a_verify_that_cannot_grade_is_diagnosed(fake):
    fake.server.inject("verify", Fault.status(500))
    done = smoke("--url", fake.url)
    assert done.returncode == 1
    assert "FAIL (verify_unavailable)" in done.stdout
    assert "verify could not grade" in done.stdout


def test_a_session_left_open_after_close_is_reported(fake):
    # A close that answers like the real one but releases nothing; no verifier, so no verify releases it either.
    fake.server.inject("close_session", Fault.respond({"resources_session_id": "x"}))
    done = smoke("--url", fake.url, "--initial-url", "site/index.html")
    assert done.returncode == 1
    assert "left open" in done.stdout


def test_a_reward_other_than_the_expected_one_fails(fake):
    done = smoke("--url", fake.url, "--initial-url", "site/index.html", "--verifier", '{"url_contains": "form.html"}')
    assert done.returncode == 0, done.stdout  # no expectation given: any graded reward passes
    assert "reward 0.0" in done.stdout
    done = smoke(
        "--url",
        fake.url,
        "--initial-url",
        "site/index.html",
        "--verifier",
        '{"url_contains": "form.html"}',
        "--click",
        "Go to form",
        "--expect-reward",
        "1.0",
    )
    assert done.returncode == 0, done.stdout
    done = smoke(
        "--url", fake.url, "--verifier", '{"url_contains": "nothing"}', "--click", "About", "--expect-reward", "1"
    )
    assert done.returncode == 1
    assert "expected 1.0" in done.stdout


def test_a_task_row_from_a_jsonl_file_gives_the_start_url_and_verifier(fake, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"id": "a", "initial_url": "site/index.html", "verifier_metadata": {"dom_contains": "Home"}})
        + "\n\n"
        + json.dumps({"id": "b", "initial_url": "site/index.html", "verifier_metadata": {"url_contains": "about"}})
    )
    done = smoke(
        "--url", fake.url, "--task-file", str(rows), "--task-id", "b", "--click", "About", "--expect-reward", "1"
    )
    assert done.returncode == 0, done.stdout
    assert '"url_contains": "about"' in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "127.0.0.1:8100"], "must be an http(s) base URL"),
        (["--url", "http://127.0.0.1:1", "--verifier", "{nope"], "--verifier is not JSON"),
        (["--url", "http://127.0.0.1:1", "--verifier", '{"title_is": "x"}'], "unknown verifier_metadata keys"),
        (["--url", "http://127.0.0.1:1", "--task-file", "/nonexistent.jsonl"], "no such file"),
        (["--url", "http://127.0.0.1:1", "--timeout", "0"], "timeouts must be positive"),
        ([], "--url"),
    ],
)
def test_usage_errors_exit_two_without_contacting_any_server(args, message):
    done = smoke(*args)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_malformed_task_file_names_the_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "a", "initial_url": "x"}\n{broken\n')
    done = smoke("--url", "http://127.0.0.1:1", "--task-file", str(rows), "--task-index", "1")
    assert done.returncode == 2
    assert f"{rows}:2: not JSON" in done.stderr


def test_help_teaches_with_examples():
    done = smoke("--help")
    assert done.returncode == 0
    assert "examples:" in done.stdout and "--task-file" in done.stdout and "exit codes" in done.stdout


@pytest.mark.integration
def test_the_bundled_episode_gets_reward_one_from_an_unmodified_real_server(real_environment):
    assert real_environment.url.startswith("http://127.0.0.1:")  # an IP host, on purpose: the cookie trap
    done = smoke("--url", real_environment.url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: episode walked and verified, reward 1.0" in done.stdout
    assert real_environment.wait_for_idle()
