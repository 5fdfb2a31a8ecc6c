"""scripts/gpu_check.sh, checked where no GPU exists: its help, its refusals, and the run it would start.

The vLLM run itself needs an NVIDIA GPU. Here: ``--help`` names the versions verl 0.9.1 pins for vLLM; the script
refuses cleanly (exit 1, the reason, nothing started) without a GPU, with a GPU but no CUDA torch and no vLLM, with
too little free GPU memory or a model head size vLLM cannot take; the overrides of ``--print-command`` compose with
verl's real configuration through ``main_ppo --cfg job`` into a valid one-GPU vLLM rollout config; and the summary
reads what verl's own file logger wrote. A missing or broken GPU is shown to the script by a small ``nvidia-smi``
stand-in on PATH that prints what the real one prints in those cases.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_gym_browser.local import policy_model, tiny_policy
from nemo_gym_browser.local import run_spec as rs
from nemo_gym_browser.local import training_run as tr

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def run_script(*args: str, path: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # The caller's allocator settings stay out unless a test sets them.
    environment = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"} | (env or {})
    if path is not None:
        environment["PATH"] = path
    return subprocess.run(
        ["bash", str(SCRIPT), "--python", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )


def path_without_nvidia_smi() -> str:
    kept = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    if not {"/usr/bin", "/bin"} & set(kept):
        pytest.skip("nvidia-smi lives next to bash and awk on this machine")
    return os.pathsep.join(kept)


def fake_nvidia_smi(folder: Path, output: str, status: int = 0) -> str:
    """A PATH whose ``nvidia-smi`` prints ``output`` and exits with ``status``, whatever it is asked."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\nexit {status}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return os.pathsep.join([str(folder), path_without_nvidia_smi()])


def vllm_extra_pins() -> dict[str, str]:
    """What verl's installed metadata pins for its ``vllm`` extra (name -> version)."""
    pins = {}
    for requirement in importlib.metadata.requires("verl") or []:
        match = re.fullmatch(r'([A-Za-z0-9_.-]+)==([^;\s]+)\s*;\s*extra\s*==\s*"vllm"', requirement.strip())
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def test_help_names_the_vllm_torch_and_transformers_versions_verl_pins_for_vllm_and_the_model_it_needs() -> None:
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    pins = vllm_extra_pins()
    assert {"vllm", "torch", "transformers"} <= pins.keys()
    assert f"vllm {pins['vllm']}" in result.stdout
    assert f"torch {pins['torch']}" in result.stdout
    assert f"transformers {pins['transformers']}" in result.stdout
    for taught in ('"verl[vllm]==0.9.1"', "setup_environment.sh", "--model DIR", "head_dim 64", "Exit status"):
        assert taught in result.stdout


def test_help_builds_the_gpu_environment_from_a_python_that_verl_and_this_recipe_both_accept() -> None:
    import tomllib

    from packaging.specifiers import SpecifierSet

    help_text = run_script("--help").stdout
    verl_takes = SpecifierSet(importlib.metadata.metadata("verl")["Requires-Python"])
    recipe_takes = SpecifierSet(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"])
    named = re.findall(r"python(3\.\d+) -m venv \.venv-gpu", help_text)
    assert named
    for version in named:
        assert version in verl_takes and version in recipe_takes, version
    # and it says which others would do: every minor version both accept
    accepted = [f"3.{minor}" for minor in range(8, 20) if f"3.{minor}" in verl_takes and f"3.{minor}" in recipe_takes]
    assert f"a Python {' or '.join(accepted)}" in help_text


def test_a_machine_without_nvidia_smi_is_refused_with_exit_1_and_pointed_at_the_cpu_backend(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    result = run_script("--workdir", str(workdir), path=path_without_nvidia_smi())
    assert result.returncode == 1
    assert "nvidia-smi not found" in result.stderr and "needs one NVIDIA GPU" in result.stderr
    assert "nemo_gym_browser.local.training_run" in result.stderr  # the CPU backend's way to the same run
    assert not workdir.exists()  # nothing was started or written


def test_a_driver_that_sees_no_gpu_is_refused(tmp_path: Path) -> None:
    path = fake_nvidia_smi(tmp_path / "bin", "No devices were found", status=6)
    result = run_script("--workdir", str(tmp_path / "work"), path=path)
    assert result.returncode == 1
    assert "nvidia-smi sees no GPU: No devices were found" in result.stderr


def test_a_gpu_with_a_cpu_only_torch_and_no_vllm_is_refused_naming_both_fixes(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available() or importlib.util.find_spec("vllm") is not None:
        pytest.skip("this environment has a CUDA torch or vLLM: the case needs the CPU-only set")
    path = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB, 80000, 81920")
    result = run_script("--workdir", str(tmp_path / "work"), path=path)
    assert result.returncode == 1
    assert f"torch {torch.__version__} cannot use the GPU: install the CUDA build" in result.stderr
    vllm = vllm_extra_pins()["vllm"]
    assert f'vLLM is not installed: pip install "verl[vllm]==0.9.1" (vllm {vllm})' in result.stderr
    assert not (tmp_path / "work").exists()


def test_a_model_whose_head_size_no_vllm_attention_backend_takes_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2}')
    path = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB, 80000, 81920")
    result = run_script("--model", str(model), "--workdir", str(tmp_path / "work"), path=path)
    assert result.returncode == 1
    assert "--model has head_dim 12: vLLM's attention backends need a multiple of 8 <= 256" in result.stderr


def test_a_gpu_mostly_in_use_by_other_processes_is_refused_before_vllm_would_fail(tmp_path: Path) -> None:
    path = fake_nvidia_smi(tmp_path / "bin", "NVIDIA L4, 9000, 23034")  # 0.4 + 0.1 of 23034 MiB > 9000 free
    result = run_script("--workdir", str(tmp_path / "work"), path=path)
    assert result.returncode == 1
    assert "NVIDIA L4 has 9000 of 23034 MiB free" in result.stderr
    assert "lower --gpu-memory-utilization" in result.stderr


def test_expandable_segments_are_refused_because_vllms_sleep_mode_asserts_on_them(tmp_path: Path) -> None:
    path = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB, 80000, 81920")
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    result = run_script("--workdir", str(tmp_path / "work"), path=path, env=env)
    assert result.returncode == 1
    assert "refuses expandable segments" in result.stderr


@pytest.mark.parametrize("args", [["--steps", "0"], ["--gpu-memory-utilization", "1.5"], ["--bogus"], ["--model"]])
def test_bad_arguments_are_a_usage_error(args: list[str]) -> None:
    result = run_script(*args)
    assert result.returncode == 2 and "see --help" in result.stderr


def printed_commands(tmp_path: Path, *args: str) -> list[list[str]]:
    result = run_script("--print-command", "--workdir", str(tmp_path / "work"), *args)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "work").exists()  # printing starts nothing
    return [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]


def options(command: list[str], name: str) -> list[str]:
    return [command[i + 1] for i, word in enumerate(command) if word == name]


def test_the_printed_run_composes_with_verls_real_config_into_a_one_gpu_vllm_rollout(tmp_path: Path) -> None:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    build, train = printed_commands(tmp_path, "--", "trainer.val_before_train=False")
    assert build[1:3] == ["-m", "nemo_gym_browser.local.tiny_policy"]
    hidden, heads = int(options(build, "--hidden-size")[0]), int(options(build, "--heads")[0])
    assert hidden % heads == 0 and hidden // heads == 64  # the head size every vLLM attention backend takes
    assert train[1:3] == ["-m", "nemo_gym_browser.local.training_run"]
    assert options(train, "--rollout") == ["vllm"] and options(train, "--model") == options(build, "--output")
    overrides = options(train, "--override")
    assert overrides[-1] == "trainer.val_before_train=False"  # the caller's own overrides come last

    # The run training_run would start: its own overrides for a vLLM rollout, then the script's.
    spec = rs.RunSpec(
        model_path=Path(options(train, "--model")[0]),
        train_file=tmp_path / "train.jsonl",
        val_file=tmp_path / "val.jsonl",
        server_urls=("http://127.0.0.1:8100",),
        output_dir=tmp_path / "work" / "run",
        rollout_name="vllm",
        extra_overrides=tuple(overrides),
    )
    result = subprocess.run(
        [*rs.main_ppo_command(spec, sys.executable), "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=rs.process_environment(spec),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = OmegaConf.create(result.stdout)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.mode == "async"
    assert config.trainer.device == "cuda" and config.trainer.nnodes == 1 and config.trainer.n_gpus_per_node == 1
    assert rollout.gpu_memory_utilization == 0.4
    assert rollout.enforce_eager is True and rollout.free_cache_engine is True and rollout.load_format == "dummy"
    assert rollout.max_model_len == spec.max_prompt_length + spec.max_response_length
    assert rollout.max_model_len <= policy_model.ModelSpec().max_position_embeddings  # verl's vLLM server checks it
    assert config.ray_kwargs.ray_init.address == "local"
    assert config.ray_kwargs.ray_init["_node_ip_address"] == "127.0.0.1"
    assert config.trainer.val_before_train is False
    if importlib.util.find_spec("flash_attn") is None:
        assert config.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
        assert config.actor_rollout_ref.model.use_remove_padding is False

    # verl's own rollout config accepts it, and one vLLM replica fills exactly the one GPU (tp x dp x pp).
    OmegaConf.resolve(config)  # as main_ppo's task runner does before building workers
    checked = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert isinstance(checked, RolloutConfig)
    replica = checked.tensor_model_parallel_size * checked.data_parallel_size * checked.pipeline_model_parallel_size
    assert replica == config.trainer.n_gpus_per_node * config.trainer.nnodes == 1


def test_with_a_model_folder_nothing_is_built_and_the_folder_is_the_policy(tmp_path: Path) -> None:
    model = tmp_path / "Qwen2.5-0.5B-Instruct"
    (train,) = printed_commands(tmp_path, "--model", str(model), "--steps", "3", "--gpu-memory-utilization", "0.3")
    assert options(train, "--model") == [str(model)] and options(train, "--steps") == ["3"]
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.3" in options(train, "--override")


def test_the_training_run_cli_and_the_policy_builder_know_every_flag_the_script_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build, train = printed_commands(tmp_path)
    assert build[3] == "build"  # the policy builder's subcommand
    for command, cli, help_args in ((build, tiny_policy, ["build", "--help"]), (train, tr, ["--help"])):
        assert command[2] == cli.__name__
        with pytest.raises(SystemExit) as exited:
            cli.main(help_args)
        assert exited.value.code == 0
        shown = capsys.readouterr().out
        for flag in {word for word in command[3:] if word.startswith("--")}:
            assert re.search(rf"(^|\s|\[){re.escape(flag)}\b", shown), f"{cli.__name__} has no {flag}"


def test_the_summary_shows_each_steps_times_reward_and_env_metrics_from_verls_file_logger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.utils.tracking import FileLogger

    metrics = tmp_path / "work" / "run" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    logger = FileLogger("nemo_gym_browser_local", "run")
    for step, (seconds, reward, resampled) in enumerate([(41.5, 0.25, 0.125), (38.25, 0.375, 0.0625)], start=1):
        timings = {"timing_s/step": seconds, "timing_s/gen": seconds - 10, "timing_s/update_actor": 2.5}
        env = {"env/invalid_rate": 0.0, "env/resampled_rate": resampled, "env/attempts/max": 2.0}
        logger.log({**timings, "critic/score/mean": reward, **env, "actor/lr": 1e-4}, step=step)
    logger.finish()

    result = run_script("--summary", "--workdir", str(tmp_path / "work"), "--steps", "2")
    assert result.returncode == 0, result.stderr
    rows = {line[:34].strip(): line[34:].split() for line in result.stdout.splitlines()[1:]}
    assert rows["step"] == ["1", "2"]
    assert rows["step s"] == ["41.500", "38.250"] and rows["gen s"] == ["31.500", "28.250"]
    assert rows["reward"] == ["0.250", "0.375"] and rows["sync s"] == ["nan", "nan"]  # not logged: shown as such
    assert rows["env/resampled_rate"] == ["0.125", "0.062"] and rows["env/attempts/max"] == ["2.000", "2.000"]
    assert "actor/lr" not in rows

    short = run_script("--summary", "--workdir", str(tmp_path / "work"), "--steps", "3")
    assert short.returncode == 1 and "main_ppo logged 2 of 3 steps" in short.stderr
