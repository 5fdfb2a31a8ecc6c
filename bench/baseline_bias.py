"""What infrastructure zeros do to GRPO's advantages, and what the recipe's wiring does instead.

For each infrastructure failure rate, GRPO groups are drawn with known outcomes (a success probability
``p ~ Uniform(0, 1)`` per prompt, reward 1 with probability ``p``), and an exact share of all rollout slots, chosen
uniformly at random, fails in the infrastructure. Three advantage computations see the same batch: (a) stock, verl's
``compute_grpo_outcome_advantage`` with the failures as reward 0; (b) recipe, verl's legacy-trainer
``compute_advantage`` with the recipe's patches installed, fed what the agent loop emits (``env_invalid``, reward 0
and a zeroed response mask for invalid samples); (c) oracle, stock GRPO on the run where nothing failed.

It prints the mean advantage of the surviving incorrect and correct samples and of the failed ones, for failure
rates 0..90 % and for the mission's case (1172 of 1280 rollouts failed: 20 groups of 64). Deterministic for a given
``--seed``. Exit 1 unless, with no failure, the recipe's advantages equal stock GRPO's and the reference case of
``docs/estimator-and-wiring.md`` holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo import core_algos, ray_trainer

from nemo_gym_browser import patches
from nemo_gym_browser.agent_attempt.sample_flags import INVALID_KEY
from nemo_gym_browser.testing.benchmarking import header, write_report

DEFAULT_PLOT = Path(__file__).resolve().parent / "baseline_bias.png"
DEFAULT_JSON = DEFAULT_PLOT.with_suffix(".json")
FAILURE_RATES = tuple(r / 100 for r in range(0, 100, 10))
# The mission's case: 1172 of 1280 rollouts failed over 20 steps of a 64-way run.
MISSION_FAILED, MISSION_STEPS, MISSION_GROUP = 1172, 20, 64
REFERENCE_REWARDS, REFERENCE_INVALID, REFERENCE_EXPECTED = [1.0, 1.0, 0.0, 0.0], 1, [2 / 3, -1 / 3, -1 / 3]

EXAMPLES = """\
examples:
  python bench/baseline_bias.py                         # table, bench/baseline_bias.png and .json
  python bench/baseline_bias.py --group-size 8 --groups 512 --plot /tmp/bias8.png
  python bench/baseline_bias.py --no-std                # Dr.GRPO (no division by the group std)

exit codes: 0 done, 1 a consistency check failed, 2 usage error
"""


@dataclass(frozen=True)
class Point:
    """Mean advantages at one failure rate. ``None`` where the batch had no sample of that kind."""

    label: str
    failure_rate: float
    incorrect: tuple[float | None, float | None, float | None]  # stock, recipe, oracle (surviving incorrect)
    correct: tuple[float | None, float | None, float | None]  # stock, recipe, oracle (surviving correct)
    failed: tuple[float | None, float | None]  # stock, recipe (slots the infrastructure failed)
    groups_without_signal: float  # share of groups with fewer than two valid samples
    samples: int


@dataclass(frozen=True)
class Batch:
    uid: np.ndarray  # group label per sample (verl's 'uid' column)
    true_reward: np.ndarray  # 1.0 correct, 0.0 incorrect: the outcome the rollout really had
    failed: np.ndarray  # the infrastructure failed this slot


def draw_outcomes(rng: np.random.Generator, *, groups: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(uid, true_reward)`` of groups of known outcomes: ``p ~ U(0, 1)`` per prompt, correct with probability p."""
    p = rng.uniform(0.0, 1.0, size=groups)
    correct = rng.random((groups, group_size)) < p[:, None]
    uid = np.repeat(np.array([f"prompt-{g}" for g in range(groups)], dtype=object), group_size)
    return uid, correct.reshape(-1).astype(np.float32)


def draw_batch(rng: np.random.Generator, *, groups: int, group_size: int, failed_slots: int) -> Batch:
    """Groups of known outcomes with exactly ``failed_slots`` failures spread uniformly over all slots."""
    uid, true_reward = draw_outcomes(rng, groups=groups, group_size=group_size)
    failed = np.zeros(len(uid), dtype=bool)
    failed[rng.choice(len(uid), size=failed_slots, replace=False)] = True
    return Batch(uid=uid, true_reward=true_reward, failed=failed)


def stock_grpo(rewards: np.ndarray, uid: np.ndarray, *, norm_by_std: bool) -> np.ndarray:
    """verl's own GRPO: one outcome reward per sample on a one-token response."""
    scores = torch.from_numpy(rewards).unsqueeze(-1)
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores,
        response_mask=torch.ones_like(scores),
        index=uid,
        norm_adv_by_std_in_grpo=norm_by_std,
    )
    return advantages[:, 0].numpy()


def recipe_grpo(rewards: np.ndarray, uid: np.ndarray, failed: np.ndarray, *, norm_by_std: bool) -> np.ndarray:
    """The legacy trainer's ``compute_advantage`` with the patches in place, on what the recipe's loop emits."""
    scores = torch.from_numpy(np.where(failed, 0.0, rewards).astype(np.float32)).unsqueeze(-1)
    response_mask = torch.from_numpy(~failed).to(torch.float32).unsqueeze(-1)  # the loop masks invalid samples
    data = DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": response_mask},
        non_tensors={"uid": uid, INVALID_KEY: failed.copy()},
    )
    data = ray_trainer.compute_advantage(
        data, adv_estimator=core_algos.AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=norm_by_std
    )
    return data.batch["advantages"][:, 0].numpy()


def _mean(values: np.ndarray, where: np.ndarray) -> float | None:
    return float(values[where].mean()) if where.any() else None


def evaluate(batches: list[Batch], *, label: str, norm_by_std: bool) -> Point:
    merged = Batch(
        uid=np.concatenate([f"b{i}-" + b.uid for i, b in enumerate(batches)]).astype(object),
        true_reward=np.concatenate([b.true_reward for b in batches]),
        failed=np.concatenate([b.failed for b in batches]),
    )
    observed = np.where(merged.failed, 0.0, merged.true_reward).astype(np.float32)
    stock = stock_grpo(observed, merged.uid, norm_by_std=norm_by_std)
    recipe = recipe_grpo(merged.true_reward, merged.uid, merged.failed, norm_by_std=norm_by_std)
    oracle = stock_grpo(merged.true_reward, merged.uid, norm_by_std=norm_by_std)

    survived = ~merged.failed
    incorrect = survived & (merged.true_reward == 0.0)
    correct = survived & (merged.true_reward == 1.0)
    _, group_of = np.unique(merged.uid.astype(str), return_inverse=True)
    valid_per_group = np.bincount(group_of, weights=survived.astype(float))
    return Point(
        label=label,
        failure_rate=float(merged.failed.mean()),
        incorrect=(_mean(stock, incorrect), _mean(recipe, incorrect), _mean(oracle, incorrect)),
        correct=(_mean(stock, correct), _mean(recipe, correct), _mean(oracle, correct)),
        failed=(_mean(stock, merged.failed), _mean(recipe, merged.failed)),
        groups_without_signal=float((valid_per_group < 2).mean()),
        samples=len(observed),
    )


def sweep(*, groups: int, group_size: int, seed: int, norm_by_std: bool, mission_repeats: int) -> list[Point]:
    """All failure rates on the same groups and outcomes; a higher rate fails a superset of the slots of a lower one
    (common random numbers, so the curves differ by the failures alone)."""
    rng = np.random.default_rng([seed, 0])
    uid, true_reward = draw_outcomes(rng, groups=groups, group_size=group_size)
    order = rng.permutation(len(uid))
    points = []
    for rate in FAILURE_RATES:
        failed = np.zeros(len(uid), dtype=bool)
        failed[order[: round(rate * len(uid))]] = True
        points.append(evaluate([Batch(uid, true_reward, failed)], label=f"{rate:.0%}", norm_by_std=norm_by_std))
    # The mission: each repeat is one run of 20 steps x 64 rollouts with exactly 1172 failures.
    mission = [
        draw_batch(
            np.random.default_rng([seed, 1000 + repeat]),
            groups=MISSION_STEPS,
            group_size=MISSION_GROUP,
            failed_slots=MISSION_FAILED,
        )
        for repeat in range(mission_repeats)
    ]
    points.append(evaluate(mission, label="mission", norm_by_std=norm_by_std))
    return points


# ----- checks ---------------------------------------------------------------------------------------------------


def check_reference_case() -> tuple[bool, list[float]]:
    """NeMo RL PR #3467: [1, 1, 0, 0] with the second invalid, no std division -> [0.667, -0.333, -0.333]."""
    rewards = np.array(REFERENCE_REWARDS, dtype=np.float32)
    failed = np.zeros(len(rewards), dtype=bool)
    failed[REFERENCE_INVALID] = True
    uid = np.array(["reference"] * len(rewards), dtype=object)
    advantages = recipe_grpo(rewards, uid, failed, norm_by_std=False)
    valid = [float(a) for a, f in zip(advantages, failed, strict=True) if not f]
    ok = np.allclose(valid, REFERENCE_EXPECTED, atol=1e-6) and advantages[REFERENCE_INVALID] == 0.0
    return bool(ok), valid


def check_no_failure_matches_stock(seed: int, norm_by_std: bool) -> bool:
    batch = draw_batch(np.random.default_rng([seed, 999]), groups=64, group_size=8, failed_slots=0)
    stock = stock_grpo(batch.true_reward, batch.uid, norm_by_std=norm_by_std)
    recipe = recipe_grpo(batch.true_reward, batch.uid, batch.failed, norm_by_std=norm_by_std)
    return bool(np.array_equal(stock, recipe))


# ----- output ---------------------------------------------------------------------------------------------------


def _cell(value: float | None) -> str:
    return f"{value:+.3f}" if value is not None else "   n/a"


def format_table(points: list[Point]) -> str:
    head = (
        f"{'failed':>14} | {'incorrect survivors':^26} | {'correct survivors':^26} | {'failed slots':^17} | "
        f"{'groups <2 valid':>15}\n"
        f"{'':>14} | {'stock':>8}{'recipe':>9}{'oracle':>9} | {'stock':>8}{'recipe':>9}{'oracle':>9} | "
        f"{'stock':>8}{'recipe':>9} | {'':>15}"
    )
    rows = []
    for p in points:
        label = f"{p.failure_rate:.1%} mission" if p.label == "mission" else f"{p.failure_rate:.0%}"
        rows.append(
            f"{label:>14} | {_cell(p.incorrect[0]):>8}{_cell(p.incorrect[1]):>9}{_cell(p.incorrect[2]):>9} | "
            f"{_cell(p.correct[0]):>8}{_cell(p.correct[1]):>9}{_cell(p.correct[2]):>9} | "
            f"{_cell(p.failed[0]):>8}{_cell(p.failed[1]):>9} | {p.groups_without_signal:>14.1%}"
        )
    return "\n".join([head, "-" * len(head.splitlines()[0]), *rows])


def plot(points: list[Point], path: Path, *, group_size: int, norm_by_std: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep_points = [p for p in points if p.label != "mission"]
    mission = next(p for p in points if p.label == "mission")
    x = [100 * p.failure_rate for p in sweep_points]
    styles = {"stock": ("tab:red", "o-"), "recipe": ("tab:blue", "s-"), "oracle": ("tab:gray", "^--")}
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharex=True)
    panels = [
        ("incorrect survivors", lambda p: p.incorrect, ("stock", "recipe", "oracle")),
        ("correct survivors", lambda p: p.correct, ("stock", "recipe", "oracle")),
        ("slots the infrastructure failed", lambda p: p.failed, ("stock", "recipe")),
    ]
    for axis, (title, values, names) in zip(axes, panels, strict=True):
        for position, name in enumerate(names):
            color, style = styles[name]
            ys = [values(p)[position] for p in sweep_points]
            axis.plot(x, [np.nan if y is None else y for y in ys], style, color=color, label=name, markersize=4)
            mission_y = values(mission)[position]
            if mission_y is not None:
                axis.plot(100 * mission.failure_rate, mission_y, "*", color=color, markersize=13, markeredgecolor="k")
        axis.axhline(0.0, color="k", linewidth=0.6)
        axis.set_title(f"mean advantage: {title}")
        axis.set_xlabel("rollouts failed by the infrastructure (%)")
        axis.grid(alpha=0.3)
    axes[0].legend(loc="best")
    axes[2].annotate(
        f"★ mission: {MISSION_FAILED}/{MISSION_STEPS * MISSION_GROUP} failed",
        xy=(0.02, 0.04),
        xycoords="axes fraction",
        fontsize=8,
    )
    normalisation = "std-normalised GRPO" if norm_by_std else "Dr.GRPO (no std division)"
    figure.suptitle(f"GRPO advantages under infrastructure failures ({group_size}-way groups, {normalisation})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _ok(passed: bool) -> str:
    return "ok" if passed else "FAIL"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baseline_bias.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--group-size", type=int, default=MISSION_GROUP, help="rollouts per prompt (default 64)")
    parser.add_argument("--groups", type=int, default=256, help="prompts per failure rate (default 256)")
    parser.add_argument("--mission-repeats", type=int, default=16, help="repeats of the 20x64 mission run (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-std", action="store_true", help="Dr.GRPO: do not divide by the group std")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"PNG to write (default {DEFAULT_PLOT})")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.group_size < 2 or args.groups < 1 or args.mission_repeats < 1:
        print(
            "baseline_bias.py: error: --group-size must be >= 2, --groups and --mission-repeats >= 1", file=sys.stderr
        )
        return 2
    started = time.perf_counter()
    print(header("baseline_bias: mean GRPO advantage under infrastructure failures"))
    patches.install()
    if patches.RAY_TRAINER not in patches.installed_targets():
        print("FAIL: the recipe's wiring is not installed on verl's legacy trainer", file=sys.stderr)
        return 1
    norm_by_std = not args.no_std
    print(
        f"setup: {args.groups} prompts x {args.group_size} rollouts per failure rate, p(correct) ~ U(0,1) per prompt, "
        f"{'std-normalised GRPO' if norm_by_std else 'Dr.GRPO'}, seed {args.seed}; mission: {args.mission_repeats} "
        f"repeats of {MISSION_STEPS} steps x {MISSION_GROUP} rollouts with {MISSION_FAILED} failed"
    )
    points = sweep(
        groups=args.groups,
        group_size=args.group_size,
        seed=args.seed,
        norm_by_std=norm_by_std,
        mission_repeats=args.mission_repeats,
    )
    print(format_table(points))
    plot(points, args.plot, group_size=args.group_size, norm_by_std=norm_by_std)
    print(f"plot: {os.path.relpath(args.plot)}")

    reference_ok, reference = check_reference_case()
    unchanged_ok = check_no_failure_matches_stock(args.seed, norm_by_std)
    print(
        f"check: reference case [1, 1*, 0, 0] -> valid {[round(v, 3) for v in reference]} "
        f"(expected [0.667, -0.333, -0.333]): {_ok(reference_ok)}"
    )
    print(f"check: with no failure the recipe's advantages equal stock GRPO's bit for bit: {_ok(unchanged_ok)}")
    columns = {"incorrect/correct": "stock, recipe, oracle", "failed": "stock, recipe"}
    checks = {"reference_case": reference_ok, "no_failure_equals_stock": unchanged_ok}
    write_report(args.json, vars(args), {"columns": columns, "points": points, "checks": checks})
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0 if reference_ok and unchanged_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
