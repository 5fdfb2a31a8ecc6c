"""Time ``grpo_env_aware`` against verl's own GRPO on the same batches and print the speed-up.

Each batch looks like what verl hands the estimator: ``token_level_rewards`` holding one outcome reward on the
last response token, a ``response_mask`` with ragged lengths, and ``uid`` strings (one ``uuid4`` per prompt,
repeated ``group size`` times, as verl's trainers build them). Three timings per batch, each the best of
``--repeats`` runs (verl's GRPO is timed once from 256k samples up: it takes seconds):

- ``verl grpo``: ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage``;
- ``env_aware``: ``grpo_env_aware`` with no flag set (must equal verl's output bit for bit, checked);
- ``env_aware+flags``: ``grpo_env_aware`` with ``--invalid-fraction`` of the samples flagged invalid.

Examples:
    python bench/grpo_speed.py                                  # 4k, 64k, 1M samples x group 8 and 16; grpo_speed.json
    python bench/grpo_speed.py --samples 4096 65536 --group-sizes 8
    python bench/grpo_speed.py --threads 1 --response-length 32

Exit status: 0 all outputs agree and grpo_env_aware was faster everywhere, 1 a check failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from nemo_gym_browser.group_stats import compute_grpo_env_aware_advantage
from nemo_gym_browser.testing.benchmarking import header, write_report

DEFAULT_JSON = Path(__file__).resolve().parent / "grpo_speed.json"
SLOW_STOCK_FROM = 1 << 18  # verl's per-sample Python loop: time it once from this batch size up


@dataclass(frozen=True)
class Batch:
    rewards: torch.Tensor
    mask: torch.Tensor
    uids: np.ndarray
    invalid: np.ndarray


@dataclass(frozen=True)
class Row:
    samples: int
    group_size: int
    stock_s: float
    ours_s: float
    ours_flagged_s: float
    identical: bool


def make_batch(samples: int, group_size: int, length: int, invalid_fraction: float, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (samples,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    rewards = torch.zeros(samples, length)
    rewards[torch.arange(samples), lengths - 1] = (torch.rand(samples, generator=generator) < 0.4).float()
    prompts = -(-samples // group_size)
    uids = np.repeat(np.array([str(uuid.UUID(int=int(i) + seed)) for i in range(prompts)], dtype=object), group_size)
    invalid = np.random.default_rng(seed).random(samples) < invalid_fraction
    return Batch(rewards=rewards, mask=mask, uids=uids[:samples], invalid=invalid)


def best_time(function: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


def measure(batch: Batch, group_size: int, repeats: int) -> Row:
    samples = len(batch.uids)
    stock_s, stock = best_time(
        lambda: compute_grpo_outcome_advantage(batch.rewards.clone(), batch.mask, batch.uids)[0],
        1 if samples >= SLOW_STOCK_FROM else repeats,
    )
    ours_s, ours = best_time(
        lambda: compute_grpo_env_aware_advantage(batch.rewards, batch.mask, batch.uids)[0], repeats
    )
    flagged_s, _ = best_time(
        lambda: compute_grpo_env_aware_advantage(batch.rewards, batch.mask, batch.uids, env_invalid=batch.invalid)[0],
        repeats,
    )
    identical = torch.equal(ours.view(torch.int32), stock.view(torch.int32))
    return Row(samples, group_size, stock_s, ours_s, flagged_s, identical)


def format_row(row: Row) -> str:
    return (
        f"{row.samples:>9,d} {row.group_size:>5d} {row.stock_s * 1e3:>13.1f} {row.ours_s * 1e3:>13.1f} "
        f"{row.ours_flagged_s * 1e3:>17.1f} {row.stock_s / row.ours_s:>9.1f}x {row.stock_s / row.ours_flagged_s:>9.1f}x"
        f"  {'yes' if row.identical else 'NO'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Examples:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--samples", type=int, nargs="+", default=[4096, 65536, 1 << 20], help="batch sizes")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[8, 16], help="rollouts per prompt")
    parser.add_argument("--response-length", type=int, default=16, help="tokens per response (default 16)")
    parser.add_argument("--invalid-fraction", type=float, default=0.1, help="flagged share for env_aware+flags")
    parser.add_argument("--repeats", type=int, default=5, help="runs per timing, best kept (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if min(args.samples) < 1 or min(args.group_sizes) < 1 or args.repeats < 1 or args.response_length < 1:
        parser.error("--samples, --group-sizes, --repeats and --response-length must be positive")
    if not 0.0 <= args.invalid_fraction <= 1.0:
        parser.error("--invalid-fraction must be within [0, 1]")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(header("grpo_speed: grpo_env_aware against verl's GRPO on the same batches"))
    print(f"{torch.get_num_threads()} torch threads, response length {args.response_length}")
    print(
        f"{'samples':>9} {'group':>5} {'verl grpo ms':>13} {'env_aware ms':>13} {'env_aware+flags ms':>17} "
        f"{'speed-up':>10} {'w/ flags':>10}  bit-identical"
    )
    rows = []
    for samples in args.samples:
        for group_size in args.group_sizes:
            batch = make_batch(samples, group_size, args.response_length, args.invalid_fraction, args.seed)
            rows.append(measure(batch, group_size, args.repeats))
            print(format_row(rows[-1]), flush=True)
    failed = [row for row in rows if not row.identical or row.ours_s >= row.stock_s]
    speed_ups = [
        {"samples": row.samples, "group_size": row.group_size, "speed_up": row.stock_s / row.ours_s} for row in rows
    ]
    write_report(args.json, vars(args), {"rows": rows, "speed_ups": speed_ups, "checks_failed": len(failed)})
    if failed:
        print(f"check failed for {len(failed)} batch(es): outputs differ or grpo_env_aware was not faster")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
