"""The web from the nodes: the dry run's start-page check (``start_pages.py``), the proxy the browser side gets, and
the warning a training step raises when most of its episodes could not open their start page.

Offline, the check runs against the in-process environment server, whose simulated browser fails a page it does not
hold as Chromium does (``net::ERR_CONNECTION_REFUSED`` for an address, ``net::ERR_NAME_NOT_RESOLVED`` for a name).
The integration tests hold that fake to the real server's answer for a start page nothing serves, and show that a
proxy in the launcher's environment reaches the real server's Chromium while its own loopback traffic bypasses it.
The warning is driven through real rollouts of the agent loop and the legacy trainer's metric function.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto
from verl.trainer.ppo import ray_trainer
from verl.trainer.ppo.reward import extract_reward

from nemo_gym_browser import patches, start_pages
from nemo_gym_browser.gym_contract.credentials import REDACTED, browser_side_environment, redact_url_credentials
from nemo_gym_browser.launch_environment import LocalEnvironment
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.environment_server.site_model import Page, Site
from nemo_gym_browser.local.in_process_loop import compose_trainer_config, make_row
from nemo_gym_browser.prepare_webvoyager_data import main as prepare_data
from nemo_gym_browser.trainer_side import exclusion_watch

SCRIPT = Path(__file__).resolve().parent.parent / "submit_webvoyager.sh"
SHOP = "http://shop.example.test/"
NOWHERE = "https://nowhere.example.test/"
ROLLOUT_TIMEOUT_S = 120


def dead_port() -> int:
    """A loopback port nothing listens on (free right now): a start page that fails without leaving the machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prepared(folder: Path, starts: list[str]) -> Path:
    """Rows, as prepare_webvoyager_data.py writes them, one per start URL in this order; the train file."""
    tasks = folder / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"web_name": "Site", "id": f"Site--{i}", "ques": f"Question {i}?", "web": url}) + "\n"
            for i, url in enumerate(starts)
        )
    )
    assert prepare_data(["--input", str(tasks), "--output-dir", str(folder / "data"), "--val-fraction", "0"]) == 0
    return folder / "data" / "train.jsonl"


@pytest.fixture
async def fake():
    """The in-process server, whose browser also holds the shop's front page."""
    async with InProcessEnvironmentServer(Site.bundled().with_pages({SHOP: Page(title="Corner Shop")})) as server:
        yield server


async def run_check(capsys, *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(start_pages.main, list(argv))
    return code, capsys.readouterr().out


# ----- the sample ---------------------------------------------------------------------------------------------------


def test_the_sample_is_one_start_page_per_host_the_hosts_most_rows_start_on_first(tmp_path):
    starts = [
        "https://b.example.test/1",
        "https://a.example.test/1",
        "https://a.example.test/2",
        "https://c.example.test/",
        "https://c.example.test:8443/",  # another port, another place to connect to
        "https://a.example.test/3",
        "https://b.example.test/2",
        "site/index.html",  # the server's own page: no web needed
    ]
    tasks = start_pages.read_tasks(prepared(tmp_path, starts))

    sample = start_pages.sample_start_pages(tasks, 3)

    assert [(page.url, page.rows) for page in sample.pages] == [
        ("https://a.example.test/1", 3),
        ("https://b.example.test/1", 2),  # ties keep the order the rows came in
        ("https://c.example.test/", 1),
    ]
    assert (sample.hosts, sample.web_rows, sample.other_rows) == (4, 7, 1)
    assert start_pages.sample_start_pages(list(reversed(tasks)), 3).pages[0].url == "https://a.example.test/3"
    assert start_pages.sample_start_pages(tasks, 3) == sample  # the same data, the same sample


# ----- the check against the in-process server ---------------------------------------------------------------------


async def test_the_check_reports_each_page_with_the_servers_message_and_fails_below_the_share(fake, tmp_path, capsys):
    dead = f"http://127.0.0.1:{dead_port()}/"
    data = prepared(tmp_path, [SHOP, SHOP, dead, NOWHERE])

    code, out = await run_check(capsys, "--url", fake.url, "--data", str(data), "--node", "n1")

    assert code == 1
    assert re.search(rf"^  ok    {re.escape(SHOP)} +\d+ ms  'Corner Shop'  \(2 row\(s\) start here\)$", out, re.M), out
    refused = re.search(rf"^  FAIL  {re.escape(dead)} .*$", out, re.M)
    assert refused, out
    assert f"/seed_session answered HTTP 500: \"Error('Page.goto: net::ERR_CONNECTION_REFUSED at {dead}" in (
        refused.group(0)
    )
    assert "Call log" not in refused.group(0) and "start-page-" not in refused.group(0)  # no call log, no session id
    assert re.search(
        rf"^  FAIL  {re.escape(NOWHERE)} .*net::ERR_NAME_NOT_RESOLVED.* -> the node cannot resolve", out, re.M
    )
    assert "1 of 3 start pages loaded on n1 (33%; at least 50% required): too few" in out
    assert "likely cause: this node may have no route to the task sites" in out
    assert "proxy for the environment server and its Chromium on n1: none" in out
    # every session seeded was closed, the failed seeds too, and the page that loaded was observed
    assert fake.open_sessions == 0
    assert sorted(fake.events(session) for session in fake.session_ids) == [
        ["seed", "close"],
        ["seed", "close"],
        ["seed", "observe", "close"],
    ]


async def test_enough_pages_loading_passes_and_the_sample_size_bounds_the_pages_opened(fake, tmp_path, capsys):
    data = prepared(tmp_path, [SHOP, SHOP, NOWHERE])

    code, out = await run_check(capsys, "--url", fake.url, "--data", str(data), "--min-share", "0.5", "--sample", "1")

    assert code == 0
    assert "start pages: 1 of the 2 host(s) that 3 row(s) start on" in out
    assert re.search(r"^1 of 1 start pages loaded on \S+ \(100%; at least 50% required\)$", out, re.M), out
    assert NOWHERE not in out and len(fake.session_ids) == 1


async def test_rows_that_need_no_web_leave_nothing_to_check(fake, tmp_path, capsys):
    data = prepared(tmp_path, ["site/index.html"])

    code, out = await run_check(capsys, "--url", fake.url, "--data", str(data), "--node", "n1")

    assert code == 0
    assert "none of the 1 row(s) starts on a web page: nothing to check on n1" in out
    assert fake.session_ids == ()


async def test_a_proxy_is_named_without_its_credentials_and_blamed_when_pages_fail(fake, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://alice:s3cr@t-pw@proxy.internal:3128")
    monkeypatch.setenv("no_proxy", ".corp.internal")
    data = prepared(tmp_path, [NOWHERE])

    code, out = await run_check(capsys, "--url", fake.url, "--data", str(data), "--node", "n1")

    assert code == 1
    assert f"HTTPS_PROXY=http://{REDACTED}@proxy.internal:3128" in out
    assert "NO_PROXY=.corp.internal,localhost,127.0.0.1,::1" in out
    assert "alice" not in out and "s3cr" not in out and "t-pw" not in out
    assert "likely cause: a proxy is set for Chromium: check that this node reaches it" in out


def test_a_malformed_data_file_is_an_input_error_and_a_bad_share_a_usage_error(tmp_path, capsys):
    broken = tmp_path / "rows.jsonl"
    broken.write_text("{not json\n")

    assert start_pages.main(["--url", "http://127.0.0.1:9", "--data", str(broken)]) == 2
    assert f"{broken}:1: malformed JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        start_pages.main(["--url", "http://127.0.0.1:9", "--data", str(broken), "--min-share", "1.5"])
    assert usage.value.code == 2


def test_help_shows_examples_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as shown:
        start_pages.main(["--help"])
    out = capsys.readouterr().out
    assert shown.value.code == 0
    assert "python start_pages.py --url http://127.0.0.1:8100 --data data/train.jsonl data/val.jsonl" in out
    assert "exit codes: 0 enough start pages loaded (or none to check), 1 too few loaded, 2 usage or input error" in out


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("START_PAGE_MIN_SHARE=1.5", "START_PAGE_MIN_SHARE must be a share between 0 and 1, not '1.5'"),
        ("START_PAGE_SAMPLE=some", "START_PAGE_SAMPLE must be a whole number, not 'some'"),
    ],
)
def test_the_submit_script_refuses_a_start_page_setting_it_cannot_use_before_starting_anything(
    tmp_path, setting, message
):
    config_env = tmp_path / "config.env"
    config_env.write_text(f"PYTHON={sys.executable}\nJUDGE_ENABLE=0\nLOG_DIR={tmp_path / 'logs'}\n{setting}\n")

    result = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(config_env), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={key: value for key, value in os.environ.items() if not key.startswith("SLURM_")},
    )

    assert result.returncode == 1, result.stdout + result.stderr
    assert message in result.stderr
    assert "cleanup: stopping 0 process(es)" in result.stdout


# ----- the proxy on the browser side --------------------------------------------------------------------------------


def test_the_browser_side_keeps_every_proxy_variable_and_never_sends_loopback_through_it():
    environ = {
        "HTTPS_PROXY": "http://proxy.internal:3128",
        "http_proxy": "http://proxy.internal:3128",
        "NO_PROXY": ".corp.internal",
        "no_proxy": "localhost, .lab.internal",
        "HF_TOKEN": "hf_0123456789",
    }

    kept = browser_side_environment(environ, TMPDIR="/tmp/x")

    assert kept["HTTPS_PROXY"] == kept["http_proxy"] == "http://proxy.internal:3128"
    # both spellings agree (Playwright reads no_proxy first, and would drop NO_PROXY's hosts otherwise)
    assert kept["NO_PROXY"] == kept["no_proxy"] == ".corp.internal,localhost,.lab.internal,127.0.0.1,::1"
    assert "HF_TOKEN" not in kept and kept["TMPDIR"] == "/tmp/x"
    # without a proxy nothing is added: a NO_PROXY alone passes as it is
    assert browser_side_environment({"NO_PROXY": ".corp.internal"}) == {"NO_PROXY": ".corp.internal"}


def test_a_urls_user_and_password_are_taken_out_whole():
    text = "HTTPS_PROXY=http://alice:p@ss:w0rd@proxy:3128/x and socks5://bob:pw@10.0.0.1:1080"

    assert redact_url_credentials(text) == (
        f"HTTPS_PROXY=http://{REDACTED}@proxy:3128/x and socks5://{REDACTED}@10.0.0.1:1080"
    )
    assert redact_url_credentials("https://example.org/a@b") == "https://example.org/a@b"  # an @ in the path stays


# ----- the warning during training ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed():
    assert patches.install() is True


def object_column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


async def legacy_step_metrics(server, model_dir, starts: list[str]) -> dict[str, float]:
    """One legacy training step's metrics over real rollouts of one task per start URL, with verl's own metric
    function (wired by the recipe), as ``RayPPOTrainer.fit`` computes them."""
    config = compose_trainer_config(
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"+nemo_gym_browser.environment.server_urls='{server.url}'",
            "+nemo_gym_browser.resample_backoff_s=0",
            "+nemo_gym_browser.max_attempts=2",
            "algorithm.adv_estimator=grpo_env_aware",
            "trainer.use_v1=false",
            f"actor_rollout_ref.rollout.n={len(starts)}",
        ]
    )
    policy = sp.ScriptedPolicy(build_chat_tokenizer(), sp.walk_and_finish("About", "ALPHA-42"))
    rows = [
        make_row(
            task=f"task {i}", task_id=f"t{i}", initial_url=url, verifier_metadata={"url_contains": "about"}, index=i
        )
        for i, url in enumerate(starts)
    ]
    prompts = DataProto(
        batch=TensorDict({"dummy_tensor": torch.zeros(len(rows), 1, dtype=torch.uint8)}, batch_size=len(rows)),
        non_tensor_batch={
            **{key: object_column([row[key] for row in rows]) for key in rows[0]},
            "uid": object_column(["group-1"] * len(rows)),
        },
        meta_info={"global_steps": 1, "validate": False},
    )
    batch = await asyncio.wait_for(AgentLoopWorker(config, policy).generate_sequences(prompts), ROLLOUT_TIMEOUT_S)
    assert server.open_sessions == 0
    # What fit does between generation and its metrics, in its order (reward -> advantage), on the driver.
    reward_tensor, reward_extra_infos = extract_reward(batch)
    batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = reward_tensor
    batch.non_tensor_batch.update({key: np.array(value) for key, value in reward_extra_infos.items()})
    batch = ray_trainer.compute_advantage(
        batch, adv_estimator=config.algorithm.adv_estimator, num_repeat=len(starts), config=config.algorithm
    )
    return ray_trainer.compute_data_metrics(batch=batch, use_critic=False)  # the name fit calls, once per step


async def test_a_step_whose_episodes_mostly_never_opened_their_start_page_warns_naming_the_sites(
    installed, server, model_dir, caplog
):
    caplog.set_level(logging.WARNING, logger=exclusion_watch.__name__)
    dead = f"http://127.0.0.1:{dead_port()}/"

    metrics = await legacy_step_metrics(server, model_dir, [dead, dead, "site/index.html"])

    assert metrics["env/seed_failed_rate"] == pytest.approx(2 / 3)
    assert metrics["env/invalid/seed_failed"] == 2.0 and metrics["env/failed_attempts/seed_failed"] == 4.0
    warnings = [record.getMessage() for record in caplog.records if record.name == exclusion_watch.__name__]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("2 of 3 episodes of this step could not open their start page on any attempt")
    assert "the nodes may not reach the task sites" in warnings[0]
    assert "run the dry run's start-page check" in warnings[0]


async def test_a_step_with_a_few_unreachable_start_pages_stays_quiet(installed, server, model_dir, caplog):
    caplog.set_level(logging.WARNING, logger=exclusion_watch.__name__)
    dead = f"http://127.0.0.1:{dead_port()}/"

    metrics = await legacy_step_metrics(server, model_dir, [dead, "site/index.html", "site/index.html"])

    assert metrics["env/seed_failed_rate"] == pytest.approx(1 / 3)
    assert not [record for record in caplog.records if "could not open their start page" in record.getMessage()]


def test_the_warning_rule_holds_from_half_of_a_steps_episodes_on():
    at_half = {"env/seed_failed_rate": exclusion_watch.SEED_FAILED_SHARE_TO_WARN, "env/samples": 4.0}
    below = {"env/seed_failed_rate": exclusion_watch.SEED_FAILED_SHARE_TO_WARN - 0.01, "env/samples": 4.0}

    assert exclusion_watch.seed_failure_warning({**at_half, "env/invalid/seed_failed": 2.0}).startswith("2 of 4")
    assert exclusion_watch.seed_failure_warning(below) is None
    assert exclusion_watch.seed_failure_warning({"env/invalid_rate": 1.0}) is None  # another recipe's step


# ----- against the real server (integration) ------------------------------------------------------------------------


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.integration)])
async def either_server(request):
    if request.param == "fake":
        async with InProcessEnvironmentServer() as fake:
            yield fake.url
    else:
        yield request.getfixturevalue("real_environment").url


async def test_both_servers_answer_a_start_page_nothing_serves_with_a_500_naming_chromiums_error(either_server):
    dead = f"http://127.0.0.1:{dead_port()}/"
    seed = {
        "resources_session_id": "start-page-contract",
        "episode_id": {"rollout_id": "start-page-contract", "attempt": 0},
        "task_id": {"taskset": "contract", "task_id": "dead"},
        "task_data": {"initial_url": dead},
    }
    close = {key: seed[key] for key in ("resources_session_id", "episode_id")}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        try:
            async with http.post(
                f"{either_server}/seed_session", json=seed, timeout=aiohttp.ClientTimeout(60)
            ) as answer:
                status, body = answer.status, await answer.json(content_type=None)
        finally:
            async with http.post(f"{either_server}/close_session", json=close, timeout=aiohttp.ClientTimeout(60)):
                pass

    assert status == 500
    assert isinstance(body, str) and body.startswith(f"Error('Page.goto: net::ERR_CONNECTION_REFUSED at {dead}"), body


class _RecordingProxy(http.server.BaseHTTPRequestHandler):
    """A web proxy on loopback: answers every proxied GET with one page, refuses every CONNECT (HTTPS), and records
    the URL or host it was asked for."""

    seen: ClassVar[list[str]] = []

    def do_CONNECT(self) -> None:
        type(self).seen.append(f"https://{self.path}/")
        self.send_response(403)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        type(self).seen.append(self.path)
        page = b"<html><head><title>Through the proxy</title></head><body>proxied</body></html>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recording_proxy() -> Iterator[str]:
    _RecordingProxy.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RecordingProxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def own_address() -> str:
    """This machine's address on its default route (a UDP connect sends nothing): not loopback, so Chromium does not
    bypass a proxy for it, and a connection to it would still never leave the machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route
        return probe.getsockname()[0]


@pytest.mark.integration
def test_a_proxy_in_the_launchers_environment_reaches_chromium_and_loopback_bypasses_it(
    recording_proxy, tmp_path, capsys, monkeypatch
):
    # What a cluster behind a proxy exports. Nothing listens at the task's address: only the proxy can serve it.
    monkeypatch.setenv("HTTP_PROXY", recording_proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    site = f"http://{own_address()}:{dead_port()}/start"
    data = prepared(tmp_path, [site])

    # The launcher's readiness probes, the server's CDP connection to its Chromium and the probe episode all go to
    # 127.0.0.1: through the proxy, the environment would not come up.
    with LocalEnvironment() as environment:
        code = start_pages.main(["--url", environment.url, "--data", str(data), "--node", "n1", "--timeout", "60"])
    out = capsys.readouterr().out

    assert code == 0, out
    assert re.search(rf"^  ok    {re.escape(site)} .* 'Through the proxy'", out, re.M), out
    assert f"HTTP_PROXY={recording_proxy}" in out and "NO_PROXY=localhost,127.0.0.1,::1" in out
    assert site in _RecordingProxy.seen  # Chromium asked the proxy for the task's page
    # and for nothing of its own (a time server, components): only the task's site, its favicon included
    assert {urlsplit(url).netloc for url in _RecordingProxy.seen} == {urlsplit(site).netloc}, _RecordingProxy.seen
    assert not [url for url in _RecordingProxy.seen if re.match(r"https?://(127\.|localhost|\[::1\])", url)]
