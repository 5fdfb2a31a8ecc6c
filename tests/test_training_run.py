"""The main_ppo driver builds a command verl accepts, reads back what verl logged, and injects faults as planned.

The real run is in tests/test_main_ppo.py (integration tier); here: the overrides composed by hydra with the
recipe's config as ``main_ppo`` composes them, the metric files in verl's own format, the fault rules on the real
proxy, the process-group handling.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_gym_browser.local import main_ppo_process as mp
from nemo_gym_browser.local import run_spec as rs
from nemo_gym_browser.local import training_run as tr
from nemo_gym_browser.local.faults import injected as inj


def spec(tmp_path: Path, **changes) -> rs.RunSpec:
    base = rs.RunSpec(
        model_path=tmp_path / "model, with a comma",
        train_file=tmp_path / "train.jsonl",
        val_file=tmp_path / "val.jsonl",
        server_urls=("http://127.0.0.1:8100", "http://127.0.0.1:8101"),
        output_dir=tmp_path / "run",
    )
    return base.replace(**changes)


def composed(spec: rs.RunSpec):
    """The config hydra composes from the driver's overrides, as ``main_ppo`` does (nothing is started)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(rs.CONFIG_DIR), version_base=None):
            return compose("webvoyager_grpo", overrides=rs.hydra_overrides(spec))
    finally:
        GlobalHydra.instance().clear()


def test_the_cpu_command_composes_with_the_recipes_config_and_the_cpu_backend(tmp_path: Path) -> None:
    run = spec(tmp_path, steps=3, prompts_per_step=2, group_size=4, save_freq=2)
    config = composed(run)
    assert config.algorithm.adv_estimator == "grpo_env_aware"
    assert config.actor_rollout_ref.rollout.name == "hfcpu" and config.trainer.device == "cpu"
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "nemo_gym_browser_agent"
    assert config.actor_rollout_ref.model.path == str(run.model_path)  # the comma stayed part of the path
    assert list(config.nemo_gym_browser.environment.server_urls) == list(run.server_urls)
    assert config.nemo_gym_browser.max_attempts == 3
    assert config.trainer.total_training_steps == 3 and config.trainer.save_freq == 2
    assert config.trainer.default_local_dir == str(run.checkpoint_dir)
    assert config.data.train_batch_size == 2 and config.actor_rollout_ref.rollout.n == 4
    assert "file" in config.trainer.logger


def test_the_stock_arm_is_verls_grpo_with_the_recipes_wiring_off_and_one_attempt(tmp_path: Path) -> None:
    run = spec(tmp_path, estimator="grpo")
    config = composed(run)
    assert config.algorithm.adv_estimator == "grpo"
    assert config.nemo_gym_browser.max_attempts == 1
    env = rs.process_environment(run, base={})
    assert env["NEMO_GYM_BROWSER_PATCHES"] == "0" and env["NEMO_GYM_BROWSER_DROP_INVALID"] == "0"
    recipe_env = rs.process_environment(spec(tmp_path, drop_invalid=True), base={})
    assert recipe_env["NEMO_GYM_BROWSER_PATCHES"] == "1" and recipe_env["NEMO_GYM_BROWSER_DROP_INVALID"] == "1"


def test_a_gpu_command_names_the_rollout_and_leaves_the_cpu_backend_out(tmp_path: Path) -> None:
    run = spec(tmp_path, rollout_name="vllm")
    overrides = rs.hydra_overrides(run)
    assert "actor_rollout_ref.rollout.name=vllm" in overrides
    assert not any(o.startswith(("trainer.device=", "+ray_kwargs.ray_init.num_gpus")) for o in overrides)
    assert "+ray_kwargs.ray_init._node_ip_address=127.0.0.1" in overrides  # Ray on loopback, as on CPU
    env = rs.process_environment(run, base={})
    assert "VERL_PLATFORM" not in env and "VERL_USE_EXTERNAL_MODULES" not in env
    config = composed(run)
    assert config.actor_rollout_ref.rollout.name == "vllm" and config.trainer.n_gpus_per_node == 1
    assert config.actor_rollout_ref.rollout.max_model_len == run.max_prompt_length + run.max_response_length


def test_every_process_of_the_run_logs_metrics_and_advantages_into_the_run_folder(tmp_path: Path) -> None:
    run = spec(tmp_path)
    env = rs.process_environment(run, base={"PYTHONPATH": "/elsewhere"})
    assert env["VERL_FILE_LOGGER_PATH"] == str(run.output_dir / "metrics.jsonl")
    assert env["NEMO_GYM_BROWSER_ADVANTAGE_LOG"] == str(run.output_dir / "advantages.jsonl")
    assert env["PYTHONPATH"].split(":") == [str(rs.RECIPE_DIR), "/elsewhere"]
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # Ray keeps its loopback node address


def test_metrics_of_one_step_logged_in_several_records_are_merged_by_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "data": {"env/samples": 8.0, "critic/score/mean": 0.25}},
        {"step": 2, "data": {"env/samples": 8.0}},
        {"step": 2, "data": {"val-core/webvoyager/reward/mean@1": 0.5}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = mp.read_step_metrics(path)
    assert steps == {
        1: {"env/samples": 8.0, "critic/score/mean": 0.25},
        2: {"env/samples": 8.0, "val-core/webvoyager/reward/mean@1": 0.5},
    }
    assert mp.metric(steps, 2, "val-core/webvoyager/reward/mean@1") == 0.5
    assert mp.metric(steps, 3, "env/samples") != mp.metric(steps, 3, "env/samples")  # NaN when not logged
    line = tr.summary_line(2, steps[2])
    assert line.split()[0] == "2" and line.split()[-1] == "0.500"
    assert len(line) == len(tr.summary_header())


def request(endpoint: str, session_id: str | None, task_id: str | None = None):
    return SimpleNamespace(endpoint=endpoint, session_id=session_id, task_id=task_id)


def test_planned_faults_break_the_first_rollouts_of_a_row_on_their_planned_attempts_only() -> None:
    rule = inj.planned_faults({3: inj.RowFault("verify", attempts=(1, 2), rollouts=1)})
    first, second = "r3-aaaa", "r3-bbbb"
    assert rule(request("seed_session", f"{first}.1.0")) is None  # the rollout is picked, but seed is not planned
    assert rule(request("verify", f"{first}.1.0")).kind == "status"
    assert rule(request("verify", f"{second}.1.1")) is None  # the row's quota of one rollout is taken
    assert rule(request("verify", f"{first}.2.2")).kind == "status"
    assert rule(request("verify", f"{first}.3.3")) is None  # attempt 3 is not planned
    assert rule(request("verify", "r4-cccc.1.0")) is None  # another row
    assert rule(request("verify", None)) is None


def test_a_row_may_carry_several_faults_each_on_its_own_rollouts_in_the_order_they_arrive() -> None:
    rule = inj.planned_faults(
        {
            1: (
                inj.RowFault("verify", attempts=(1, 2, 3), rollouts=1),
                inj.RowFault("verify", attempts=(1,), rollouts=2, fault="regrade", skip=1),
            )
        }
    )
    first, second, third, fourth = (f"r1-{n:04x}" for n in range(4))
    assert rule(request("seed_session", f"{first}.1.0")) is None
    for name in (second, third, fourth):
        assert rule(request("seed_session", f"{name}.1.0")) is None
    assert rule(request("verify", f"{first}.1.0")).kind == "status"
    assert rule(request("verify", f"{second}.1.1")).kind == "regrade"
    assert rule(request("verify", f"{second}.1.1")).reward == 1.0
    assert rule(request("verify", f"{third}.1.2")).kind == "regrade"
    assert rule(request("verify", f"{fourth}.1.3")) is None  # past skip + rollouts
    assert rule(request("verify", f"{second}.2.4")) is None  # the regrade is planned on attempt 1 only
    with pytest.raises(ValueError, match="unknown fault"):
        inj.planned_faults({0: inj.RowFault("verify", attempts=(1,), rollouts=1, fault="typo")})


def test_random_faults_hit_about_their_rate_the_same_way_every_time_and_spare_the_named_tasks() -> None:
    sessions = [f"r{i}-{i:04x}.1.{i}" for i in range(2000)]
    rule = inj.random_faults(0.3, seed=7)
    hits = [rule(request("verify", s)) is not None for s in sessions]
    assert 0.27 < sum(hits) / len(hits) < 0.33
    assert hits == [inj.random_faults(0.3, seed=7)(request("verify", s)) is not None for s in sessions]
    assert hits != [inj.random_faults(0.3, seed=8)(request("verify", s)) is not None for s in sessions]
    assert not any(rule(request("seed_session", s)) for s in sessions)  # only the named endpoint
    spared = inj.random_faults(1.0, seed=7, spare_tasks=frozenset({"held-back"}))
    assert spared(request("verify", sessions[0], "held-back")) is None
    assert spared(request("verify", sessions[0], "train")).kind == "status"
    assert inj.random_faults(1.0, seed=7, kind="lose_session")(request("verify", sessions[0])).kind == "lose_session"
    with pytest.raises(ValueError):
        inj.random_faults(1.5, seed=0)


def test_the_default_fault_spec_is_todays_verify_503_per_session_and_browser_call_faults_are_one_flag_away() -> None:
    sessions = [f"r{i}-{i:04x}.1.{i}" for i in range(500)]
    default = inj.FaultSpec(rate=0.3).rule(7, spare_tasks=frozenset({"held-back"}))
    legacy = inj.random_faults(0.3, 7, spare_tasks=frozenset({"held-back"}))
    for session in sessions:
        assert (default(request("verify", session)) is None) == (legacy(request("verify", session)) is None)
        assert default(request("browser_observe", session)) is None
    assert default(request("verify", sessions[0], "held-back")) is None
    assert rs.RunSpec.__dataclass_fields__["faults"].default == inj.FaultSpec(0.0, "verify", "status")

    calls = inj.FaultSpec(rate=1.0, at="browser-call", kind="hang").rule(7, spare_tasks=frozenset({"held-back"}))
    assert calls(request("browser_click", sessions[0])).kind == "hang"
    assert calls(request("verify", sessions[0])) is None
    assert calls(request("browser_click", sessions[1], "held-back")) is None
    for bad in ({"rate": -0.1}, {"at": "nowhere"}, {"kind": "regrade"}, {"at": "seed", "kind": "lose_session"}):
        with pytest.raises(ValueError):
            inj.FaultSpec(**bad)


def test_a_shorter_call_timeout_reaches_the_loops_settings_and_none_keeps_the_recipes(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from nemo_gym_browser.local.in_process_loop import agent_loop_entry
    from nemo_gym_browser.settings import resolve_settings

    loop_kwargs = OmegaConf.to_container(agent_loop_entry())
    del loop_kwargs["name"], loop_kwargs["_target_"]  # what hydra.utils.instantiate passes the loop

    def call_timeout(run: rs.RunSpec) -> float:
        return resolve_settings(loop_kwargs, composed(run)).environment.call_timeout_s

    assert call_timeout(spec(tmp_path, call_timeout_s=15.0)) == 15.0
    assert call_timeout(spec(tmp_path)) == 120.0  # the setting's default
    with pytest.raises(ValueError):
        spec(tmp_path, call_timeout_s=0)


def test_the_cli_teaches_every_fault_option_and_refuses_bad_values_as_usage_errors(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as shown:
        tr.main(["--help"])
    text = capsys.readouterr().out
    assert shown.value.code == 0
    for kind in ("--fault-at browser-call", "--call-timeout", "status", "lose_session", "hang"):
        assert kind in text
    for recorded in ("server_error", "session_lost", "timeout", "verify_unavailable"):  # what the loop will record
        assert recorded in text
    bad = (["--fault-rate", "1.5"], ["--fault-at", "nowhere"], ["--fault-kind", "drop"], ["--call-timeout", "0"])
    for argv in (*bad, ["--fault-at", "seed", "--fault-kind", "lose_session"], ["--max-sessions", "0"]):
        with pytest.raises(SystemExit) as refused:
            tr.main(["--workdir", str(tmp_path), *argv])
        assert refused.value.code == 2
    assert not any(tmp_path.iterdir())  # refused before anything was built


def test_injected_faults_run_the_real_proxy_in_a_thread_and_count_what_they_injected() -> None:
    from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer

    with InProcessEnvironmentServer().run_in_thread() as fake:
        with inj.InjectedFaults(fake.url, lambda r: inj.random_faults(1.0, 0, "seed_session")(r)) as faults:
            import urllib.error
            import urllib.request

            body = json.dumps({"resources_session_id": "r0-ab.1.0"}).encode()
            post = urllib.request.Request(f"{faults.url}/seed_session", data=body, method="POST")
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(post, timeout=10)
            assert answer.value.code == 503
            assert faults.counts() == {"status": 1}
            assert faults.open_session_ids == ()


def test_a_run_past_its_timeout_is_stopped_with_its_whole_process_group(tmp_path: Path, monkeypatch) -> None:
    run = spec(tmp_path)
    marker = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(marker)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(600)"
    )
    monkeypatch.setattr(mp, "main_ppo_command", lambda spec, python=sys.executable: [python, "-c", script])
    lines: list[str] = []
    # long enough for two interpreters to start on a loaded machine (5 s was not, with CI's integration tier beside)
    result = mp.run_main_ppo(run, timeout_s=15, on_line=lines.append)
    assert not result.ok and lines == ["started"]
    assert result.peak_memory_bytes > 2 * 2**20  # two Python interpreters were sampled while they ran
    child = int(marker.read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert "started" in run.log_path.read_text()


def test_a_sigterm_to_the_driver_stops_the_runs_whole_process_group(tmp_path: Path) -> None:
    """A driver stopped from outside (a cancelled job, a Ctrl-C in another shell) leaves no trainer behind."""
    marker = tmp_path / "child.pid"
    driver = f"""
import sys
from pathlib import Path
from nemo_gym_browser.local import main_ppo_process as mp
from nemo_gym_browser.local import run_spec as rs

script = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "open({str(marker)!r}, 'w').write(str(child.pid)); time.sleep(600)"
)
mp.main_ppo_command = lambda spec, python=sys.executable: [python, "-c", script]
spec = rs.RunSpec(model_path=Path("m"), train_file=Path("t"), val_file=Path("v"),
                  server_urls=("http://127.0.0.1:1",), output_dir=Path({str(tmp_path / "run")!r}))
mp.run_main_ppo(spec, timeout_s=600)
"""
    process = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and process.poll() is None, "the driver did not start its run"
        time.sleep(0.2)
    child = int(marker.read_text())
    process.terminate()
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the run's process outlived its driver"
        time.sleep(0.2)


def test_unseedable_tasks_fail_every_seed_of_a_drawn_task_and_nothing_else() -> None:
    tasks = [f"task-{i}" for i in range(400)]
    rule = inj.FaultSpec(rate=0.25, at="seed").rule(3, spare_tasks=frozenset({"task-0"}))
    drawn = {t for t in tasks if rule(request("seed_session", f"r{t}-aa.1.0", t)) is not None}
    assert 0.19 < len(drawn) / len(tasks) < 0.31 and "task-0" not in drawn
    for task in list(drawn)[:5]:  # every attempt of every rollout of a drawn task
        for session in ("r1-bb.2.7", "r1-cc.3.9", "r9-dd.1.1"):
            fault = rule(request("seed_session", session, task))
            assert (fault.kind, fault.http_status) == ("status", 500)  # the server's own answer to a dead start page
        assert (
            rule(request("verify", "r1-bb.1.0", task)) is None
            and rule(request("browser_click", "r1-bb.1.0", task)) is None
        )
    assert (
        inj.FaultSpec(rate=1.0, at="seed", kind="hang").rule(3)(request("seed_session", "r1-a.1.0", "t")).kind == "hang"
    )


def test_ctrl_c_ends_the_command_with_one_line_and_no_traceback(monkeypatch, capsys) -> None:
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(tr, "_run", interrupted)
    assert tr.main(["--workdir", "/nonexistent"]) == 130
    out, err = capsys.readouterr()
    assert out.strip() == "interrupted: main_ppo, the fault proxy, the environment server and Chromium are stopped"
    assert "Traceback" not in out + err


def test_a_second_run_while_the_shop_site_is_served_stops_with_one_line_naming_the_port(tmp_path, capsys) -> None:
    """The shop's task URLs name the site's port, so two local runs cannot share a machine: the second one says so."""
    from nemo_gym_browser.local import shop_tasks
    from nemo_gym_browser.local.local_site import LocalSiteBusy

    with shop_tasks.serve() as first:
        port = first.port
        with pytest.raises(LocalSiteBusy, match=f"127.0.0.1:{port} is taken"), shop_tasks.serve():
            pass
        assert tr.main(["--workdir", str(tmp_path), "--environment", "real", "--suite", "deal", "--steps", "1"]) == 1
    out, err = capsys.readouterr()
    assert f"training_run: error: 127.0.0.1:{port} is taken" in err
    assert "Traceback" not in out + err
