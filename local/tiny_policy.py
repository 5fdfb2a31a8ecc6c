"""The tiny policy for the Corner Shop, built and measured from the command line (see the README's "A tiny policy").

:func:`build` makes the tokenizer and the model (:mod:`.policy_model`), warm-starts it on demonstrations
(:mod:`.warm_start`) and writes a model folder that verl's ``HFModelConfig`` and transformers'
``AutoModelForCausalLM`` load: ``config.json``, weights, tokenizer files and :data:`REPORT_FILE` with the
settings and measurements. :func:`build_deal` builds the deal policy in two phases (shipped as
:data:`DEAL_POLICY_DIR`), :func:`build_aisle` the aisle policy from it (shipped as :data:`AISLE_POLICY_DIR`).
``evaluate`` measures a folder with :mod:`.policy_evaluation`.

Deterministic for a seed and a thread count; CPU only, no network, everything stays in the output folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2ForCausalLM

from ..settings import SAMPLE_MODES
from . import shop_tasks
from .policy_evaluation import evaluate
from .policy_model import ModelSpec, build_model, parameter_count, policy_tokenizer
from .warm_start import Demonstration, WarmStartSpec, collect_demonstrations, load_samples, warm_start

REPORT_FILE = "warm_start.json"

# The deal tasks' policy (build_deal; shipped as DEAL_POLICY_DIR). Two phases: solver demonstrations (always read
# the board) until reading the mark is in the policy's repertoire (3,000 steps: at 400 and 1,500 it read the mark
# on 25 % and 51 % of held-back boards, where 25 % is chance; at 3,000 on all of them), then demonstrations of
# which three in four answer at once from memory, so that the policy mostly guesses. Demonstrations that read the
# board and then name a wrong fruit were tried for the second phase instead (100-300 steps): they undid the
# reading (25-35 % right after observing), and RL then had nothing to lift.
DEAL_MODEL = ModelSpec(initializer_range=0.1)
DEAL_SOLVER = WarmStartSpec(correct=1.0, guess=0.0, demos_per_task=1, steps=3000, batch_size=32, lr=3e-3,
                            warmup_steps=100)  # fmt: skip
DEAL_MIXED = WarmStartSpec(correct=1.0, guess=0.75, demos_per_task=1, steps=200, batch_size=32, lr=1e-3,
                           warmup_steps=20, seed=1)  # fmt: skip
DEAL_POLICY_DIR = Path(__file__).resolve().parent / "deal_policy"

# The aisle tasks' policy (build_aisle; shipped as AISLE_POLICY_DIR), continued from the deal policy, which already
# names the fruit a board marks: solver demonstrations (observe, click the aisle marked (deal), name the fruit its
# stand marks) until pointing at the marked aisle's link is in its repertoire too, then demonstrations of which four
# in five answer at once from memory. The first phase plays one sample per episode (three turns a sample: the most
# to learn from per token); the second plays every task in both sample modes, so the policy has seen the prompts of
# either (a step-wise prompt shows only the latest observation).
AISLE_SOLVER = WarmStartSpec(correct=1.0, guess=0.0, demos_per_task=1, steps=600, batch_size=32, lr=3e-3,
                             warmup_steps=50)  # fmt: skip
AISLE_MIXED = WarmStartSpec(correct=1.0, guess=0.8, demos_per_task=1, steps=300, batch_size=32, lr=1e-3,
                            warmup_steps=20, seed=1)  # fmt: skip
AISLE_SOLVER_MODES = ("trajectory",)
AISLE_MIXED_MODES = SAMPLE_MODES
AISLE_POLICY_DIR = Path(__file__).resolve().parent / "aisle_policy"


@dataclass
class WarmStartReport:
    parameters: int
    model: dict[str, Any]
    warm_start: dict[str, Any]
    demonstrations: int
    demonstration_success: float
    tokens_per_episode: dict[str, float]
    model_tokens_per_episode: float
    demo_seconds: float
    train_seconds: float
    losses: list[float] = field(default_factory=list)
    start_from: dict[str, Any] | None = None  # the report of the folder this one continued from, losses left out
    sample_modes: list[str] = field(default_factory=lambda: ["trajectory"])  # how the demonstrations were played


def build(
    output_dir: Path,
    *,
    model_spec: ModelSpec = ModelSpec(),  # noqa: B008 (frozen)
    warm: WarmStartSpec = WarmStartSpec(),  # noqa: B008 (frozen)
    task_file: Path = shop_tasks.TRAIN_FILE,
    start_from: Path | None = None,
    sample_modes: Sequence[str] = ("trajectory",),
) -> WarmStartReport:
    """Build the tokenizer and the model, warm-start it on demonstrations of ``task_file``'s tasks, save the folder.

    ``start_from``: continue from the weights of a folder this function wrote (same tokenizer) instead of a new
    model; ``model_spec`` is then that folder's. ``sample_modes``: play each task in each of these modes
    (``settings.SAMPLE_MODES``).
    """
    output_dir = Path(output_dir)
    tokenizer = policy_tokenizer()
    # from start_from: train_and_save loads its weights and spec
    model = build_model(tokenizer, model_spec, warm.seed) if start_from is None else None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tiny-policy-") as workdir:
        samples = load_samples(Path(task_file), Path(workdir))
        demos = asyncio.run(
            collect_demonstrations(
                tokenizer,
                samples,
                correct=warm.correct,
                per_task=warm.demos_per_task,
                seed=warm.seed,
                guess=warm.guess,
                sample_modes=sample_modes,
            )
        )
    demo_seconds = time.monotonic() - started
    return train_and_save(
        output_dir,
        demos,
        tokenizer=tokenizer,
        warm=warm,
        demo_seconds=demo_seconds,
        model=model,
        model_spec=model_spec if start_from is None else None,
        start_from=start_from,
        sample_modes=sample_modes,
    )


def train_and_save(
    output_dir: Path,
    demos: Sequence[Demonstration],
    *,
    tokenizer: Any,
    warm: WarmStartSpec,
    demo_seconds: float,
    model: Qwen2ForCausalLM | None = None,
    model_spec: ModelSpec | None = None,
    start_from: Path | None = None,
    sample_modes: Sequence[str] = ("trajectory",),
) -> WarmStartReport:
    """Warm-start ``model`` (or the weights of ``start_from``, a folder :func:`build` wrote with this tokenizer) on
    ``demos`` and save the folder with its report; the demonstrations may come from any suite's player."""
    if model is None:
        if start_from is None:
            raise ValueError("a model or a folder to start from is needed")
        model = Qwen2ForCausalLM.from_pretrained(start_from, attn_implementation="sdpa")
        if model.config.vocab_size != len(tokenizer):
            raise ValueError(f"{start_from} was built with another tokenizer ({model.config.vocab_size} tokens)")
    if model_spec is None:
        if start_from is None:
            raise ValueError("the model's spec or the folder it came from is needed")
        model_spec = ModelSpec(**json.loads((Path(start_from) / REPORT_FILE).read_text())["model"])
    started = time.monotonic()
    losses = warm_start(model, demos, warm, tokenizer.pad_token_id) if warm.steps > 0 else []
    train_seconds = time.monotonic() - started

    kinds = sorted({demo.kind for demo in demos})
    report = WarmStartReport(
        parameters=parameter_count(model),
        model=asdict(model_spec),
        warm_start=asdict(warm),
        demonstrations=len(demos),
        demonstration_success=sum((demo.reward or 0.0) for demo in demos) / len(demos),
        tokens_per_episode={
            kind: sum(d.length for d in demos if d.kind == kind) / sum(1 for d in demos if d.kind == kind)
            for kind in kinds
        },
        model_tokens_per_episode=sum(sum(d.response_mask) for d in demos) / len(demos),
        demo_seconds=round(demo_seconds, 2),
        train_seconds=round(train_seconds, 2),
        losses=[round(loss, 4) for loss in losses],
        start_from=_summary(start_from) if start_from is not None else None,
        sample_modes=list(sample_modes),
    )
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    (output_dir / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def _summary(folder: Path) -> dict[str, Any]:
    report = json.loads((Path(folder) / REPORT_FILE).read_text())
    report["final_loss"] = report["losses"][-1] if report.get("losses") else None
    report.pop("losses", None)
    return report


def build_deal(output_dir: Path, *, seed: int = 0, solver_dir: Path | None = None) -> WarmStartReport:
    """The deal policy: :data:`DEAL_SOLVER` into ``solver_dir`` (default: ``output_dir`` with ``-solver`` appended;
    kept, and reused when it is already there), then :data:`DEAL_MIXED` from its weights into ``output_dir``. Seeds
    are offset by ``seed``. About 15 minutes on 2 cores, 13 of them for the solver."""
    output_dir = Path(output_dir)
    solver_dir = Path(solver_dir) if solver_dir is not None else output_dir.with_name(output_dir.name + "-solver")
    if not (solver_dir / REPORT_FILE).exists():
        build(
            solver_dir,
            model_spec=DEAL_MODEL,
            warm=replace(DEAL_SOLVER, seed=DEAL_SOLVER.seed + seed),
            task_file=shop_tasks.DEAL_TRAIN_FILE,
        )
    return build(
        output_dir,
        warm=replace(DEAL_MIXED, seed=DEAL_MIXED.seed + seed),
        task_file=shop_tasks.DEAL_TRAIN_FILE,
        start_from=solver_dir,
    )


def build_aisle(output_dir: Path, *, seed: int = 0, solver_dir: Path | None = None) -> WarmStartReport:
    """The aisle policy: :data:`AISLE_SOLVER` from the deal policy's weights into ``solver_dir`` (default:
    ``output_dir`` with ``-solver`` appended; kept, and reused when it is already there), then :data:`AISLE_MIXED`
    from its weights into ``output_dir``, in :data:`AISLE_SOLVER_MODES` and :data:`AISLE_MIXED_MODES`. Seeds are
    offset by ``seed``."""
    output_dir = Path(output_dir)
    solver_dir = Path(solver_dir) if solver_dir is not None else output_dir.with_name(output_dir.name + "-solver")
    if not (solver_dir / REPORT_FILE).exists():
        build(
            solver_dir,
            warm=replace(AISLE_SOLVER, seed=AISLE_SOLVER.seed + seed),
            task_file=shop_tasks.AISLE_TRAIN_FILE,
            start_from=DEAL_POLICY_DIR,
            sample_modes=AISLE_SOLVER_MODES,
        )
    return build(
        output_dir,
        warm=replace(AISLE_MIXED, seed=AISLE_MIXED.seed + seed),
        task_file=shop_tasks.AISLE_TRAIN_FILE,
        start_from=solver_dir,
        sample_modes=AISLE_MIXED_MODES,
    )


_EPILOG = f"""\
examples:
  # the default policy, then its success rates on the training and the held-back tasks
  python -m nemo_gym_browser.local.tiny_policy build --output /tmp/tiny-policy
  python -m nemo_gym_browser.local.tiny_policy evaluate --model /tmp/tiny-policy --episodes-per-task 2

  # another size and another share of demonstrations that pick the named element
  python -m nemo_gym_browser.local.tiny_policy build --output /tmp/tiny-policy --hidden-size 128 --correct 0.6

  # the untrained model and its tokenizer only (no demonstrations, no training)
  python -m nemo_gym_browser.local.tiny_policy build --output /tmp/untrained --steps 0

  # the deal policy (shipped as local/deal_policy/; about 15 minutes), and how it does on the deal tasks
  python -m nemo_gym_browser.local.tiny_policy --threads 2 build-deal --output /tmp/deal-policy
  python -m nemo_gym_browser.local.tiny_policy evaluate --suite deal --model local/deal_policy --limit 96

  # the aisle policy (shipped as local/aisle_policy/; continues from local/deal_policy), on held-back aisle days
  python -m nemo_gym_browser.local.tiny_policy --threads 2 build-aisle --output /tmp/aisle-policy
  python -m nemo_gym_browser.local.tiny_policy evaluate --suite aisle --model local/aisle_policy --split heldback \\
      --temperature 1 --episodes-per-task 2

what build writes to --output:
  config.json, model.safetensors, generation_config.json and the tokenizer files (chat template included): a
  folder AutoModelForCausalLM and verl's HFModelConfig load; and {REPORT_FILE}: parameters, settings,
  demonstrations, tokens per episode, timings and the loss of every step.

what evaluate does:
  runs every task of both files through the recipe's real agent loop against the in-process environment server, the
  model served by the hfcpu rollout server in-process; sampled (--temperature, default 1 and 0 = greedy), and
  prints the success rate per split and kind, the share of turns that were one well-formed tool call, and tokens
  per episode.

the tasks: {shop_tasks.TRAIN_FILE.name} (demonstrated) and {shop_tasks.HELD_BACK_FILE.name} (held back: other
items of the same kinds, never demonstrated); see python -m nemo_gym_browser.local.shop_tasks --help.

exit status: 0 done, 2 usage error."""


def _parser() -> argparse.ArgumentParser:
    defaults, warm = ModelSpec(), WarmStartSpec()
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.tiny_policy",
        description="A tiny Qwen2 policy for the Corner Shop tasks. build: make the model and warm-start it on CPU "
        "on demonstrations the scripted policy plays through the recipe's real agent loop against the in-process "
        "environment server (loss on exactly the tokens the loop marked as the model's). evaluate: measure its "
        "success through the same loop.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress and debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{build,build-deal,build-aisle,evaluate}")

    build_cmd = commands.add_parser("build", help="build and warm-start a policy folder", epilog=_EPILOG,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    build_cmd.add_argument("--output", type=Path, required=True, metavar="DIR", help="the model folder to write")
    build_cmd.add_argument("--seed", type=int, default=warm.seed, help="seed of weights, demonstrations, batches")
    build_cmd.add_argument(
        "--start-from", type=Path, metavar="DIR",
        help="continue from the weights of a folder build wrote (its model settings apply) instead of a new model",
    )  # fmt: skip
    build_cmd.add_argument(
        "--suite", choices=shop_tasks.SUITES, default="lookup",
        help="the training tasks to demonstrate: lookup (act on the element the task names), deal (name the item "
        "marked on sale; answered at once from memory by a --guess share of demonstrations) or aisle (the same, "
        "after clicking the aisle the start page marks) (default %(default)s)",
    )  # fmt: skip
    model = build_cmd.add_argument_group("model")
    model.add_argument("--hidden-size", type=int, default=defaults.hidden_size, help="default %(default)s")
    model.add_argument("--layers", type=int, default=defaults.num_layers, help="default %(default)s")
    model.add_argument("--heads", type=int, default=defaults.num_heads, help="default %(default)s")
    model.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads, help="default %(default)s")
    model.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size, help="default %(default)s")
    model.add_argument(
        "--init-range", type=float, default=defaults.initializer_range,
        help="standard deviation of the initial weights (default %(default)s)",
    )  # fmt: skip
    train = build_cmd.add_argument_group("warm start")
    train.add_argument(
        "--correct", type=float, default=warm.correct,
        help="probability that a demonstration picks the element the task names (default %(default)s)",
    )  # fmt: skip
    train.add_argument(
        "--guess", type=float, default=warm.guess,
        help="deal suite: share of demonstrations that answer at once without the browser (default %(default)s)",
    )  # fmt: skip
    train.add_argument("--demos-per-task", type=int, default=warm.demos_per_task, help="default %(default)s")
    train.add_argument("--steps", type=int, default=warm.steps, help="optimiser steps (default %(default)s)")
    train.add_argument("--batch-size", type=int, default=warm.batch_size, help="episodes per step (%(default)s)")
    train.add_argument("--lr", type=float, default=warm.lr, help="peak learning rate (default %(default)s)")
    train.add_argument("--warmup-steps", type=int, default=warm.warmup_steps, help="default %(default)s")
    train.add_argument(
        "--sample-mode", nargs="+", choices=SAMPLE_MODES, default=["trajectory"],
        help="play every task in each of these modes: one sample per episode (trajectory) or per policy step "
        "(stepwise) (default: trajectory)",
    )  # fmt: skip

    deal_cmd = commands.add_parser(
        "build-deal", help="build the deal policy: solver demonstrations, then both routes (DEAL_SOLVER, DEAL_MIXED)",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    deal_cmd.add_argument("--output", type=Path, required=True, metavar="DIR", help="the model folder to write")
    deal_cmd.add_argument("--seed", type=int, default=0, help="added to both phases' seeds (default 0)")
    deal_cmd.add_argument(
        "--solver", type=Path, metavar="DIR",
        help="where the first phase's policy goes (default: --output with -solver appended); reused if present",
    )  # fmt: skip

    aisle_cmd = commands.add_parser(
        "build-aisle", help="build the aisle policy from the deal policy: solver demonstrations, then both routes "
        "(AISLE_SOLVER, AISLE_MIXED)", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    aisle_cmd.add_argument("--output", type=Path, required=True, metavar="DIR", help="the model folder to write")
    aisle_cmd.add_argument("--seed", type=int, default=0, help="added to both phases' seeds (default 0)")
    aisle_cmd.add_argument(
        "--solver", type=Path, metavar="DIR",
        help="where the first phase's policy goes (default: --output with -solver appended); reused if present",
    )  # fmt: skip

    evaluate_cmd = commands.add_parser("evaluate", help="success rates through the real loop", epilog=_EPILOG,
                                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    evaluate_cmd.add_argument("--model", type=Path, required=True, metavar="DIR", help="a folder build wrote")
    evaluate_cmd.add_argument(
        "--temperature", type=float, action="append", default=None,
        help="sampling temperature, repeatable; 0 is greedy (default: 1 and 0)",
    )  # fmt: skip
    evaluate_cmd.add_argument(
        "--episodes-per-task", type=int, default=1, help="sampled episodes per task (%(default)s)"
    )
    evaluate_cmd.add_argument("--suite", choices=shop_tasks.SUITES, default="lookup",
                              help="which task suite (default %(default)s)")  # fmt: skip
    evaluate_cmd.add_argument("--split", choices=("train", "heldback"), action="append", default=None,
                              help="which task file(s), repeatable (default: both)")  # fmt: skip
    evaluate_cmd.add_argument("--limit", type=int, default=None, help="the first N tasks of each kind per split")
    evaluate_cmd.add_argument("--seed", type=int, default=0, help="the rollout server's sampling seed")
    evaluate_cmd.add_argument("--sample-mode", choices=SAMPLE_MODES, default="trajectory",
                              help="the prompts the policy sees: the whole episode (trajectory) or step-wise mode's "
                              "bounded ones (default %(default)s)")  # fmt: skip
    evaluate_cmd.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results here")
    return parser


def _build(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden-size must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if not 0.0 <= args.correct <= 1.0 or not 0.0 <= args.guess <= 1.0:
        parser.error("--correct and --guess must be in [0, 1]")
    if args.init_range <= 0:
        parser.error("--init-range must be positive")
    if min(args.demos_per_task, args.batch_size, args.layers) < 1 or args.steps < 0 or args.lr <= 0:
        parser.error("--demos-per-task, --batch-size and --layers must be positive, --steps >= 0, --lr > 0")
    spec = ModelSpec(
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        initializer_range=args.init_range,
    )
    warm = WarmStartSpec(
        correct=args.correct,
        guess=args.guess,
        demos_per_task=args.demos_per_task,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=min(args.warmup_steps, args.steps),
        seed=args.seed,
    )
    if args.start_from is not None and not (args.start_from / REPORT_FILE).is_file():
        parser.error(f"--start-from {args.start_from} has no {REPORT_FILE} (write one with the build command)")
    task_file = shop_tasks.SUITE_FILES[args.suite][0]
    report = build(
        args.output,
        model_spec=spec,
        warm=warm,
        task_file=task_file,
        start_from=args.start_from,
        sample_modes=args.sample_mode,
    )
    last = report.losses[-20:]
    print(
        f"wrote {args.output}: {report.parameters:,} parameters; {report.demonstrations} demonstrations "
        f"({report.demonstration_success:.0%} solved) in {report.demo_seconds:.1f} s; {len(report.losses)} steps "
        f"in {report.train_seconds:.1f} s" + (f", final loss {sum(last) / len(last):.3f}" if last else "")
    )
    return 0


def _evaluate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model} has no config.json (write one with the build command)")
    if args.episodes_per_task < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--episodes-per-task and --limit must be positive")
    files = dict(zip(("train", "heldback"), shop_tasks.SUITE_FILES[args.suite], strict=True))
    with tempfile.TemporaryDirectory(prefix="tiny-policy-eval-") as workdir:
        samples = {split: load_samples(files[split], Path(workdir)) for split in args.split or files}
    if args.limit is not None:
        kinds = {task_id: record["kind"] for task_id, record in shop_tasks.records_by_id().items()}
        for split, split_samples in samples.items():
            seen: dict[str, int] = {}
            kept = []
            for sample in split_samples:
                kind = kinds[sample["extra_info"]["task_id"]]
                seen[kind] = seen.get(kind, 0) + 1
                if seen[kind] <= args.limit:
                    kept.append(sample)
            samples[split] = kept
    results = asyncio.run(
        evaluate(
            args.model,
            samples,
            temperatures=args.temperature or (1.0, 0.0),
            episodes_per_task=args.episodes_per_task,
            seed=args.seed,
            sample_mode=args.sample_mode,
        )
    )
    print(
        f"{'split':<9} {'temp':>4} {'episodes':>8} {'success':>7}  {'by kind':<52} {'tool calls':>10} {'browsed':>7} "
        f"{'tokens':>6}"
    )
    for result in results:
        kinds = " ".join(f"{kind} {rate:.2f}" for kind, rate in result.success_by_kind.items())
        print(
            f"{result.split:<9} {result.temperature:>4g} {result.episodes:>8} {result.success:>7.2f}  {kinds:<52} "
            f"{result.tool_call_rate:>10.2f} {result.browsed:>7.2f} {result.tokens_per_episode:>6.0f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(result) for result in results], indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    if args.command == "build":
        return _build(args, parser)
    if args.command == "build-deal":
        report = build_deal(args.output, seed=args.seed, solver_dir=args.solver)
        print(f"wrote {args.output}: {report.parameters:,} parameters; final loss {report.losses[-1]:.3f}")
        return 0
    if args.command == "build-aisle":
        report = build_aisle(args.output, seed=args.seed, solver_dir=args.solver)
        print(f"wrote {args.output}: {report.parameters:,} parameters; final loss {report.losses[-1]:.3f}")
        return 0
    return _evaluate(args, parser)


if __name__ == "__main__":
    raise SystemExit(main())
