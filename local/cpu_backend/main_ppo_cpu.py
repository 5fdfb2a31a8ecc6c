"""Run verl's real ``main_ppo`` on CPU: the ``cpu`` platform, the ``hfcpu`` rollout, a random tiny model, a toy reward.

Writes a tiny seeded Qwen2 (``toy.save_random_policy``) and a 4-row parquet data set into ``--workdir``, then runs
``python -m verl.trainer.main_ppo`` with ``single_turn_agent``, GRPO, the toy reward of ``toy.compute_score``,
:func:`cpu_env` over the current environment and :func:`cpu_overrides` plus :func:`toy_overrides` (and any
overrides after ``--``). Ray runs on 127.0.0.1 without a dashboard and stops with the run. A hand check of the whole
training step on a machine without a GPU, not a CI test (what it measured:
``docs/rehearsal-and-cpu-training.md#the-cpu-backend-in-detail``).

Examples::

    python -m nemo_gym_browser.local.cpu_backend.main_ppo_cpu --workdir /tmp/cpu-ppo
    python -m nemo_gym_browser.local.cpu_backend.main_ppo_cpu --workdir /tmp/cpu-ppo --steps 3 \
        -- actor_rollout_ref.rollout.n=4
    python -m nemo_gym_browser.local.cpu_backend.main_ppo_cpu --workdir /tmp/cpu-ppo --print-only

Exit status: ``main_ppo``'s own (0 when it finished); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from . import cpu_env, cpu_overrides
from .toy import save_random_policy, write_toy_dataset

__all__ = ["main", "main_ppo_command", "toy_overrides"]

REWARD_MODULE = "pkg://nemo_gym_browser.local.cpu_backend.toy"


def toy_overrides(workdir: str | Path, *, steps: int = 2) -> list[str]:
    """The run's own overrides: toy data and model in ``workdir``, batch sizes for two cores, the toy reward."""
    workdir = Path(workdir)
    return [
        f"data.train_files={workdir / 'data' / 'train.parquet'}",
        f"data.val_files={workdir / 'data' / 'val.parquet'}",
        "data.train_batch_size=2",
        "data.max_prompt_length=128",
        "data.max_response_length=32",
        "data.dataloader_num_workers=0",
        "data.filter_overlong_prompts=False",
        f"actor_rollout_ref.model.path={workdir / 'model'}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent",
        "algorithm.adv_estimator=grpo",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={REWARD_MODULE}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={int(steps)}",
        "trainer.resume_mode=disable",
        "trainer.project_name=cpu_backend",
        "trainer.experiment_name=toy",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
    ]


def main_ppo_command(workdir: str | Path, *, steps: int = 2, extra: list[str] | None = None) -> list[str]:
    """The ``main_ppo`` command line (run it with :func:`cpu_env` merged over the environment)."""
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        *cpu_overrides(),
        *toy_overrides(workdir, steps=steps),
        *(extra or []),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--workdir", required=True, type=Path, help="scratch folder for model, data and checkpoints")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--print-only", action="store_true", help="write the assets, print env and command, stop")
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides (after --)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    workdir = args.workdir.resolve()
    save_random_policy(workdir / "model")
    write_toy_dataset(workdir / "data")
    env = cpu_env()
    command = main_ppo_command(workdir, steps=args.steps, extra=args.overrides)
    print(" ".join(f"{key}={shlex.quote(value)}" for key, value in env.items()))
    print(shlex.join(command))
    if args.print_only:
        return 0
    return subprocess.run(command, env={**os.environ, **env}, cwd=workdir, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
