"""node_check.py, offline: the CLI run as the submit script runs it (this test process's Python: verl 0.9.1 on CPU
torch), and its browser-side checks against small stand-ins.

The stand-in Chromium is a shell script that answers ``--version``; the stand-in gym venv is the layout
``scripts/setup_environment.sh`` leaves (``bin/python``, the server folder, the marker) whose ``bin/python`` runs this
interpreter over stub packages of the names the check imports. The real Chromium and gym venv are checked by the
Slurm tier, where the script runs this on both hosts.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_browser import node_check
from nemo_gym_browser.launch_environment import (
    PLAYWRIGHT_BROWSERS_SUBDIR,
    SETUP_MARKER,
    EnvironmentStartError,
    LocalEnvironment,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "node_check.py"
HOST = socket.gethostname().split(".")[0]
SERVER_PACKAGE = Path("resources_servers") / "interactive_browser"


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_chromium(folder: Path) -> Path:
    return executable(folder / "chromium", '#!/bin/sh\n[ "$1" = --version ] && echo "Chromium 150.0 (stand-in)"\n')


def fake_gym_venv(root: Path) -> Path:
    """A completed gym venv whose ``bin/python`` is this interpreter over stubs of nemo-gym and its server's imports."""
    site = root / "lib" / "python3.11" / "site-packages"
    for package in ("nemo_gym", "playwright", "fastapi", "uvicorn", "resources_servers", str(SERVER_PACKAGE)):
        (site / package).mkdir(parents=True, exist_ok=True)
        (site / package / "__init__.py").write_text("")
    (site / SERVER_PACKAGE / "app.py").write_text("# stand-in\n")
    (site / "nemo_gym-0.7.0.dist-info").mkdir()
    (site / "nemo_gym-0.7.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nemo-gym\nVersion: 0.7.0\n"
    )
    executable(root / "bin" / "python", f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    (root / SETUP_MARKER).write_text("stand-in")
    return root


def run_node_check(*args: str, cpu: bool) -> subprocess.CompletedProcess[str]:
    """node_check.py in its own process, as a job step runs it: with VERL_PLATFORM=cpu exported or without it."""
    env = {key: value for key, value in os.environ.items() if key not in {"VERL_PLATFORM", "SLURMD_NODENAME"}}
    if cpu:
        env["VERL_PLATFORM"] = "cpu"
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )


def lines_of(output: str, check: str) -> list[str]:
    return [line for line in output.splitlines() if f" {check}: " in line]


def test_a_cpu_torch_without_verl_platform_cpu_fails_naming_the_host_and_the_fix() -> None:
    done = run_node_check("--no-environment-server", cpu=False)
    assert done.returncode == 1, done.stdout + done.stderr
    (torch_line,) = lines_of(done.stdout, "torch")
    assert torch_line.startswith(f"node-check {HOST}: FAIL torch: torch ")
    assert f"in {sys.executable} is not a CUDA build (torch.version.cuda is None)" in torch_line
    assert "fix: set PYTHON in config.env to a Python whose torch is a CUDA build" in torch_line
    assert "export VERL_PLATFORM=cpu" in torch_line
    # the recipe's settings (rollout vllm, verl's default attention) need what this CPU venv lacks, each named
    (vllm_line,) = lines_of(done.stdout, "vllm")
    assert "FAIL vllm: rollout vllm needs vllm==" in vllm_line and "fix: pip install 'vllm==" in vllm_line
    (attention_line,) = lines_of(done.stdout, "flash-attn")
    assert "FAIL flash-attn: attn_implementation flash_attention_2" in attention_line
    assert f"{node_check.ATTENTION_KEY}=sdpa" in attention_line
    assert done.stdout.splitlines()[-1].startswith(f"node-check {HOST}: 3 of 6 checks failed in ")


def test_with_verl_platform_cpu_the_cpu_torch_passes_and_the_report_says_cuda_was_not_checked(tmp_path: Path) -> None:
    chromium, gym_venv = fake_chromium(tmp_path), fake_gym_venv(tmp_path / "venv-gym")
    done = run_node_check("--chromium", str(chromium), "--gym-venv", str(gym_venv), cpu=True)
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout.splitlines()
    assert report[0] == f"node-check {HOST}: {sys.executable} (Python {sys.version.split()[0]})"
    assert f"node-check {HOST}: ok   verl: verl 0.9.1 (REQUIRED_VERL.txt: 0.9.1)" in report
    (torch_line,) = lines_of(done.stdout, "torch")
    assert torch_line.endswith(": CPU run (VERL_PLATFORM=cpu): CUDA not checked")
    assert f"node-check {HOST}: ok   chromium: {chromium}: Chromium 150.0 (stand-in)" in report
    (gym_line,) = lines_of(done.stdout, "gym-venv")
    assert gym_line.startswith(f"node-check {HOST}: ok   gym-venv: {gym_venv}: nemo-gym 0.7.0 imports on Python ")
    assert report[-1].startswith(f"node-check {HOST}: all 6 checks passed in ")


def test_a_missing_chromium_is_named_with_where_to_set_its_path(tmp_path: Path) -> None:
    finding = node_check.check_chromium(tmp_path / "absent" / "chromium")
    assert not finding.ok
    assert finding.detail == f"no {tmp_path / 'absent' / 'chromium'} on this node"
    assert "apt-get install chromium" in finding.fix and "set CHROMIUM_PATH in config.env" in finding.fix

    broken = executable(
        tmp_path / "broken-chromium", "#!/bin/sh\necho 'libnss3.so: cannot open shared object' >&2\nexit 127\n"
    )
    finding = node_check.check_chromium(broken)
    assert not finding.ok
    assert finding.detail == f"{broken} --version exited 127: libnss3.so: cannot open shared object"


def test_a_gym_venv_whose_python_links_to_an_interpreter_missing_on_this_node_is_named(tmp_path: Path) -> None:
    gym_venv = fake_gym_venv(tmp_path / "venv-gym")
    python = gym_venv / "bin" / "python"
    python.unlink()
    python.symlink_to("/opt/build-host-only/bin/python3.11")  # as a venv built on another host links
    finding = node_check.check_gym_venv(gym_venv)
    assert not finding.ok
    assert f"{python} links to /opt/build-host-only/bin/python3.11, which is missing on {socket.gethostname()}" in (
        finding.detail
    )
    assert f"FORCE=1 GYM_VENV={gym_venv} bash scripts/setup_environment.sh" in finding.detail


def test_a_gym_venv_whose_python_cannot_import_nemo_gym_is_named_with_the_rebuild(tmp_path: Path) -> None:
    gym_venv = fake_gym_venv(tmp_path / "venv-gym")
    (gym_venv / "bin" / "python").unlink()
    (gym_venv / "bin" / "python").symlink_to(sys.executable)  # runs, but without the venv's packages
    finding = node_check.check_gym_venv(gym_venv)
    assert not finding.ok
    assert "cannot import nemo-gym's server: ModuleNotFoundError: No module named 'nemo_gym'" in finding.detail
    assert finding.fix == f"FORCE=1 GYM_VENV={gym_venv} bash scripts/setup_environment.sh"


def test_the_rollout_and_attention_settings_follow_the_overrides_over_the_recipe_and_verls_default(
    tmp_path: Path,
) -> None:
    recipe = node_check.settings_from_overrides([])
    assert (recipe.rollout, recipe.attention) == ("vllm", "flash_attention_2")  # the recipe's, then verl's default
    overridden = node_check.settings_from_overrides(
        ["actor_rollout_ref.rollout.name=hfcpu", "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]
    )
    assert (overridden.rollout, overridden.attention) == ("hfcpu", "sdpa")
    whole = node_check.settings_from_overrides(["actor_rollout_ref.model.override_config={attn_implementation:eager}"])
    assert whole.attention == "eager"

    composed = tmp_path / "composed.yaml"
    composed.write_text("actor_rollout_ref:\n  rollout:\n    name: sglang\n  model:\n    override_config: {}\n")
    from_config = node_check.settings_from_config(composed)
    assert (from_config.rollout, from_config.attention, from_config.source) == (
        "sglang",
        "flash_attention_2",
        str(composed),
    )


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1"}, (8, "SLURM_GPUS_ON_NODE=8")),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, (4, "CUDA_VISIBLE_DEVICES=0,1,2,3")),
        ({"SLURM_JOB_GPUS": "2,3"}, (2, "SLURM_JOB_GPUS=2,3")),
        ({"SLURM_GPUS_ON_NODE": "0"}, None),  # sbatch --gpus-per-node=0: a dry run without GPUs
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
        ({}, None),
    ],
)
def test_the_gpus_slurm_gave_come_from_its_most_specific_variable(environ, expected) -> None:
    assert node_check.gpus_given(environ) == expected


def test_the_vllm_version_is_the_one_verls_own_metadata_pins() -> None:
    import importlib.metadata

    pins = [text.split(";")[0].strip() for text in importlib.metadata.requires("verl") if text.startswith("vllm")]
    assert pins == ["vllm==0.24.0"]  # verl 0.9.1's vllm extra
    assert node_check._verl_pin("vllm") == "vllm==0.24.0"


def test_the_chromium_path_reaches_a_local_playwright_server_as_its_playwright_browsers_folder(tmp_path: Path) -> None:
    # nemo-gym 0.7.0 takes no browser path: its Playwright looks in PLAYWRIGHT_BROWSERS_PATH. The gym venv's folder
    # (as the setup script lays it out) links to the build host's Chromium; the server gets a copy of that layout
    # whose links point at the Chromium given. The stand-in server records what it was given, then fails to start.
    gym_venv = fake_gym_venv(tmp_path / "venv-gym")
    template = gym_venv / PLAYWRIGHT_BROWSERS_SUBDIR / "chromium-1234"
    (template / "chrome-linux64").mkdir(parents=True)
    (template / "chrome-linux64" / "chrome").symlink_to("/build-host/chromium")
    (template / "INSTALLATION_COMPLETE").write_text("")
    record = tmp_path / "browsers.txt"
    executable(
        gym_venv / "bin" / "python",
        '#!/bin/sh\ncd "$PLAYWRIGHT_BROWSERS_PATH" && '
        f'find . -type l -printf "%p -> %l\\n" -o -type f -print > {record}\nexit 1\n',
    )
    chromium = fake_chromium(tmp_path / "site-chromium")
    with pytest.raises(EnvironmentStartError):
        LocalEnvironment(backend="local_playwright", gym_venv=gym_venv, chromium=chromium, startup_timeout_s=30).start()
    assert sorted(record.read_text().splitlines()) == [
        "./chromium-1234/INSTALLATION_COMPLETE",
        f"./chromium-1234/chrome-linux64/chrome -> {chromium}",
    ]
    assert (template / "chrome-linux64" / "chrome").readlink() == Path("/build-host/chromium")  # the venv's untouched

    missing = tmp_path / "absent-chromium"
    with pytest.raises(EnvironmentStartError, match=f"{missing} not found on .*or pass --chromium PATH"):
        LocalEnvironment(backend="local_playwright", gym_venv=gym_venv, chromium=missing).start()
