"""A few steps of verl's real ``main_ppo`` with this recipe on this machine, from the command line.

It assembles what a local run needs and runs it: the task rows (:func:`prepare_task_rows`), a warm-started tiny
policy (:func:`tiny_policy_folder`, :func:`deal_policy_folder`, :func:`aisle_policy_folder`), the Corner Shop
behind a real ``interactive_browser`` (:func:`shop_environment`, or in :func:`main` directly) with the fault proxy
in front of it (:mod:`.faults.injected`), then :func:`.main_ppo_process.run_main_ppo` for a
:class:`.run_spec.RunSpec`, printing one line per step (:func:`summary_line`) as verl logs it. The environment
server and the proxy are stopped when the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..task_lists.task_rows import DATA_SOURCE
from ..trainer_side.wiring import INVALID_FRACTION_METRIC
from .faults.injected import FAULT_KINDS, FAULT_POINTS, FaultSpec, InjectedFaults
from .local_site import LocalSiteBusy
from .main_ppo_process import read_step_metrics, run_main_ppo
from .run_spec import (
    CPU_ROLLOUT,
    RECIPE_ESTIMATOR,
    SESSIONS_PER_CORE,
    STOCK_ESTIMATOR,
    VLLM_CPU_ENGINE,
    RunSpec,
    local_session_cap,
    main_ppo_python,
)

# --engine: what serves the policy on this machine without a GPU. hfcpu: the project's HF server
# (local/cpu_backend); vllm: verl's own vLLM rollout on vLLM's CPU build (local/vllm_cpu, .venv-vllm).
ENGINES = {"hfcpu": CPU_ROLLOUT, "vllm": VLLM_CPU_ENGINE}
# With --engine vllm every step's rollout log-probs (from the weights synced after the step before, or before step 1)
# must equal the actor's recomputed ones: verl logs the largest difference of the two probabilities per step.
SYNC_CHECK_KEY = "training/rollout_probs_diff_max"
SYNC_TOLERANCE = 1e-3

# The compact per-step line the CLI prints: (metric key, column title, format).
SUMMARY_COLUMNS = (
    ("timing_s/step", "step s", "{:7.1f}"),
    ("timing_s/gen", "gen s", "{:6.1f}"),
    ("critic/score/mean", "reward", "{:6.3f}"),
    ("env/browsed_rate", "browsed", "{:7.3f}"),
    (SYNC_CHECK_KEY, "probs diff", "{:10.1e}"),
    ("env/invalid_rate", "invalid", "{:7.3f}"),
    ("env/resampled_rate", "resampled", "{:9.3f}"),
    (INVALID_FRACTION_METRIC, "flagged", "{:7.3f}"),
    (f"val-core/{DATA_SOURCE}/reward/mean@1", "held-back success", "{:17.3f}"),
)


def summary_header() -> str:
    widths = [len(fmt.format(0.0)) for _, _, fmt in SUMMARY_COLUMNS]
    return "step " + " ".join(title.rjust(width) for (_, title, _), width in zip(SUMMARY_COLUMNS, widths, strict=True))


def summary_line(step: int, metrics: Mapping[str, Any]) -> str:
    cells = []
    for key, _, fmt in SUMMARY_COLUMNS:
        value = metrics.get(key)
        cells.append(fmt.format(float(value)) if value is not None else "-".rjust(len(fmt.format(0.0))))
    return f"{step:4d} " + " ".join(cells)


def prepare_task_rows(workdir: Path, train_tasks: Path, val_tasks: Path) -> tuple[Path, Path]:
    """Rows for ``main_ppo`` from two WebVoyager-format task files (``data-train/``, ``data-val/`` in ``workdir``)."""
    from ..prepare_webvoyager_data import prepare_rows

    return prepare_rows(train_tasks, workdir / "data-train"), prepare_rows(val_tasks, workdir / "data-val")


def tiny_policy_folder(workdir: Path, seed: int = 0) -> Path:
    """The warm-started tiny policy for the shop tasks, built once per ``workdir`` (about a minute on 2 cores)."""
    from . import tiny_policy
    from .warm_start import WarmStartSpec

    folder = workdir / f"tiny-policy-seed{seed}"
    if not (folder / tiny_policy.REPORT_FILE).exists():
        tiny_policy.build(folder, warm=WarmStartSpec(seed=seed))
    return folder


def deal_policy_folder(workdir: Path, seed: int = 0) -> Path:
    """The tiny policy warm-started for the deal tasks: the shipped ``local/deal_policy/`` for seed 0 (built by
    ``tiny_policy build-deal``, about 15 minutes), else built once per ``workdir`` with that seed."""
    from . import tiny_policy

    if seed == 0 and (tiny_policy.DEAL_POLICY_DIR / tiny_policy.REPORT_FILE).exists():
        return tiny_policy.DEAL_POLICY_DIR
    folder = workdir / f"deal-policy-seed{seed}"
    if not (folder / tiny_policy.REPORT_FILE).exists():
        tiny_policy.build_deal(folder, seed=seed)
    return folder


def aisle_policy_folder(workdir: Path | None = None, seed: int = 0) -> Path:
    """The tiny policy warm-started for the aisle tasks: the shipped ``local/aisle_policy/`` for seed 0 (built by
    ``tiny_policy build-aisle`` from the deal policy), else built once per ``workdir`` with that seed."""
    from . import tiny_policy

    if seed == 0 and (tiny_policy.AISLE_POLICY_DIR / tiny_policy.REPORT_FILE).exists():
        return tiny_policy.AISLE_POLICY_DIR
    if workdir is None:
        raise ValueError(f"no shipped aisle policy for seed {seed}: a workdir to build it in is needed")
    folder = workdir / f"aisle-policy-seed{seed}"
    if not (folder / tiny_policy.REPORT_FILE).exists():
        tiny_policy.build_aisle(folder, seed=seed)
    return folder


POLICY_FOLDERS = {"deal": deal_policy_folder, "aisle": aisle_policy_folder}


@contextlib.contextmanager
def shop_environment(kind: str = "real") -> Iterator[str]:
    """The URL of an ``interactive_browser`` serving the Corner Shop: nemo-gym 0.7.0 with Chromium on 127.0.0.1
    (``real``, the site served on its fixed port) or the fake server in a thread (``fake``: the same observations,
    checked against Chromium by the integration tier, for the CPU's sake)."""
    from . import shop_tasks

    if kind == "fake":
        from .environment_server.server import InProcessEnvironmentServer

        with InProcessEnvironmentServer(site=shop_tasks.in_process_site()).run_in_thread() as fake:
            yield fake.url
    elif kind == "real":
        from ..launch_environment import LocalEnvironment

        with shop_tasks.serve(), LocalEnvironment() as real:
            yield real.url
    else:
        raise ValueError(f"environment must be 'real' or 'fake', not {kind!r}")


def _parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.training_run",
        description="Train a policy for a few steps with verl's real main_ppo and this recipe, on this machine: the "
        "local Corner Shop site, a real nemo-gym interactive_browser with headless Chromium on 127.0.0.1, the fault "
        "proxy injecting infrastructure failures, BrowserToolAgentLoop and grpo_env_aware. Prints one line per step.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
examples:
  # two steps of the warm-started tiny policy on the CPU backend (a few minutes on 2 cores)
  python -m nemo_gym_browser.local.training_run --workdir /tmp/train

  # 30 % of training episodes spoiled by the environment (verify answers 503; never the held-back tasks that
  # validation runs), stock GRPO instead of the recipe
  python -m nemo_gym_browser.local.training_run --workdir /tmp/stock --fault-rate 0.3 --estimator grpo

  # each browser call (observe, navigate, click, type) of a training episode loses its session with chance 0.1:
  # an episode that browses more fails more often, one that finishes at once never
  python -m nemo_gym_browser.local.training_run --workdir /tmp/calls --fault-rate 0.1 --fault-at browser-call \\
      --fault-kind lose_session

  # browser calls that never answer, each cut after 15 s instead of the recipe's 120 s
  python -m nemo_gym_browser.local.training_run --workdir /tmp/hangs --fault-rate 0.1 --fault-at browser-call \\
      --fault-kind hang --call-timeout 15

  # one GPU with vLLM (see scripts/gpu_check.sh)
  python -m nemo_gym_browser.local.training_run --workdir /tmp/gpu --rollout vllm \\
      --model /models/Qwen2.5-0.5B-Instruct

injected faults: the fault proxy between the trainer and the environment server fails training sessions (never
those of the held-back tasks), each fault an infrastructure failure the recipe re-runs and stock GRPO scores 0.
  --fault-at verify        a share --fault-rate of sessions fails at verify, after the policy acted however much
                           it browsed (the default; the draw is per session)
  --fault-at browser-call  each observe, navigate, click and type call fails with chance --fault-rate, drawn per
                           call; seed, finish, verify and close never fail
  --fault-at seed          a share --fault-rate of the tasks can never be seeded (every attempt of every rollout
                           of theirs: rollouts that never reach the model), drawn per task
  --fault-kind             what the faulted call meets, and what the loop records (at a browser call / at verify):
      status               the proxy answers 503 (the default): server_error / verify_unavailable
      lose_session         the proxy strips the session cookie, so the server no longer knows the session:
                           session_lost / session_lost
      hang                 the call is held until the client gives up: timeout after --call-timeout /
                           verify_unavailable after the verify timeout (60 s). No quicker form is recorded as
                           timeout, so a hang costs a whole call timeout: lower --call-timeout with it
At seed, status is the server's own 500 for a start page that never loads (seed_failed) and hang waits out the seed
timeout. The draws are hashes of --seed and the session id (and the call's place in its session; the task id at
seed), so they depend neither
on timing nor on other sessions; the proxy's counts are printed at the end.

what is written to --workdir: the task rows, the tiny policy (unless --model), and run/ with main_ppo.log,
metrics.jsonl (verl's own per-step metrics), advantages.jsonl (every sample's flag, score and advantage) and
checkpoints/.

The CPU backend (rollout hfcpu) stands in for vLLM on machines without a GPU; it is never meant for GPU nodes.
exit status: 0 trained, 1 training failed, 2 usage error.""",
    )
    parser.add_argument(
        "--workdir", type=Path, required=True, metavar="DIR", help="where the rows, the policy and run/ go (see below)"
    )
    parser.add_argument(
        "--suite",
        choices=("lookup", "deal", "aisle"),
        default="lookup",
        help="the Corner Shop tasks: lookup (act on the element the task names, out of the tiny policy's reach; "
        "default), deal (name the fruit a board marks on sale, by reading the board or from memory: learnable) or "
        "aisle (the same, a click away: observe the aisles, click the marked one, read its board)",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps (default %(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="GRPO groups per step (default %(default)s)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per group, rollout.n (default %(default)s)")
    parser.add_argument(
        "--estimator",
        choices=(RECIPE_ESTIMATOR, STOCK_ESTIMATOR),
        default=RECIPE_ESTIMATOR,
        help=f"{RECIPE_ESTIMATOR} (the recipe, default) or {STOCK_ESTIMATOR} (stock verl GRPO: the recipe's wiring "
        "off, one attempt, failures scored 0)",
    )
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="chance of an injected fault, per session (--fault-at verify) or per browser call (browser-call); "
        "default 0, none",
    )
    parser.add_argument(
        "--fault-at",
        choices=FAULT_POINTS,
        default=FaultSpec.at,
        help="where faults strike: verify (default) or every browser action call (see below)",
    )
    parser.add_argument(
        "--fault-kind",
        choices=FAULT_KINDS,
        default=FaultSpec.kind,
        help="what a faulted call meets: status (503, default), lose_session or hang (see below)",
    )
    parser.add_argument(
        "--call-timeout",
        type=float,
        metavar="S",
        help="seconds a browser call may take before it is an infrastructure timeout (default: the setting's "
        "default, 120); each hang fault at a browser call costs this long",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=local_session_cap(),
        metavar="N",
        help=f"browsers open at once; more episodes wait for one (default %(default)s: {SESSIONS_PER_CORE} per core, "
        "what bench/session_capacity.py found this kind of machine serves beside training)",
    )
    parser.add_argument("--lr", type=float, default=RunSpec.lr, help="default %(default)s")
    parser.add_argument(
        "--test-freq", type=int, default=-1, help="validate on the held-back tasks every N steps (default: never)"
    )
    parser.add_argument(
        "--val-tasks", type=int, metavar="N", help="validate on the first N held-back tasks only (default: all)"
    )
    parser.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default="hfcpu",
        help="what serves the policy without a GPU: hfcpu (the project's HF server, default) or vllm (verl's own vLLM "
        "rollout on vLLM's CPU build; main_ppo then runs with .venv-vllm's python, scripts/setup_vllm.sh; the deal "
        "and tiny policies are served as head_dim-32 copies, local/wide_heads.py; every step must show rollout and "
        f"actor probabilities within {SYNC_TOLERANCE:g})",
    )
    parser.add_argument(
        "--environment",
        choices=("real", "fake"),
        default="real",
        help="the interactive_browser behind the fault proxy: real (nemo-gym with Chromium, default) or fake (the "
        "project's fake server in a thread, same observations, no Chromium)",
    )
    parser.add_argument("--rollout", help="a GPU machine's rollout backend name (vllm: scripts/gpu_check.sh)")
    parser.add_argument("--model", type=Path, help="a model folder (default: build and warm-start the tiny policy)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the warm start, the data order and the fault draw")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds before the run is stopped (default %(default)s)"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra hydra override for main_ppo, repeatable (e.g. nemo_gym_browser.trajectory_dir=DIR)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command; Ctrl-C stops the run (main_ppo's process group, the proxy, the environment) and says so."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        # the with-blocks and run_main_ppo stopped everything they started on the way out
        print("\ninterrupted: main_ppo, the fault proxy, the environment server and Chromium are stopped", flush=True)
        return 130
    except LocalSiteBusy as exc:
        print(f"training_run: error: {exc}", file=sys.stderr, flush=True)
        return 1


def _run(argv: Sequence[str] | None) -> int:
    from . import shop_tasks

    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompts_per_step < 1 or args.group_size < 1:
        parser.error("--steps, --prompts-per-step and --group-size must be at least 1")
    try:
        faults_spec = FaultSpec(rate=args.fault_rate, at=args.fault_at, kind=args.fault_kind)
    except ValueError as exc:
        parser.error(f"--fault-rate/--fault-at/--fault-kind: {exc}")
    if args.call_timeout is not None and args.call_timeout <= 0:
        parser.error("--call-timeout must be positive")
    if args.max_sessions < 1:
        parser.error("--max-sessions must be at least 1")
    if args.val_tasks is not None and args.val_tasks < 1:
        parser.error("--val-tasks must be at least 1")
    rollout = args.rollout or ENGINES[args.engine]
    if args.rollout is not None and args.engine != "hfcpu":
        parser.error("--rollout (a GPU machine's backend) and --engine (this machine's) exclude each other")
    if args.rollout is not None and args.model is None:
        # the CPU policy's attention heads (16 wide) are narrower than vLLM's FlashInfer and Triton backends take
        parser.error(f"--rollout {args.rollout} needs --model (scripts/gpu_check.sh builds a policy vLLM can serve)")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    train, val = prepare_task_rows(workdir, *shop_tasks.SUITE_FILES[args.suite])
    if args.val_tasks is not None:
        lines = val.read_text(encoding="utf-8").splitlines(keepends=True)
        val.write_text("".join(lines[: args.val_tasks]), encoding="utf-8")
    if args.model is None and not (args.suite in POLICY_FOLDERS and args.seed == 0):  # seed 0's are shipped
        print(f"building and warm-starting the tiny policy for the {args.suite} tasks ...", flush=True)
    policy_folder = POLICY_FOLDERS.get(args.suite, tiny_policy_folder)
    model = args.model.resolve() if args.model else policy_folder(workdir, args.seed)
    if rollout == VLLM_CPU_ENGINE:
        model = vllm_servable(model, workdir)
    print(f"model {model}; tasks {train} / held back {val}", flush=True)

    with shop_environment(args.environment) as environment_url:
        held_back = frozenset(record["id"] for record in shop_tasks.task_records("heldback", suite=args.suite))
        rule = faults_spec.rule(args.seed, spare_tasks=held_back)
        with InjectedFaults(environment_url, rule) as faults:
            spec = RunSpec(
                model_path=model,
                train_file=train,
                val_file=val,
                server_urls=(faults.url,),
                output_dir=workdir / "run",
                steps=args.steps,
                prompts_per_step=args.prompts_per_step,
                group_size=args.group_size,
                estimator=args.estimator,
                lr=args.lr,
                test_freq=args.test_freq,
                val_before_train=args.test_freq > 0,
                seed=args.seed,
                rollout_name=rollout,
                extra_overrides=tuple(args.override),
                faults=faults_spec,
                call_timeout_s=args.call_timeout,
                max_sessions_per_server=args.max_sessions,
            )
            print(f"main_ppo: {spec.log_path}\n{summary_header()}", flush=True)
            result = run_main_ppo(
                spec, timeout_s=args.timeout, python=main_ppo_python(spec), on_line=_step_printer(spec)
            )
            left_open = faults.open_session_ids
            injected = faults.counts()
    print(
        f"main_ppo exited {result.returncode} after {result.elapsed_s:.0f} s; peak memory "
        f"{result.peak_memory_bytes / 2**30:.1f} GiB for the whole run (main_ppo, environment server, Chromium; PSS), "
        f"{result.machine_peak_used_bytes / 2**30:.1f} GiB in use on the machine; "
        f"sessions left open: {len(left_open)}; "
        f"faults injected at {faults_spec.at}: {injected or 'none'}"
    )
    if not result.ok:
        print(result.log_tail(40), file=sys.stderr)
        return 1
    print(before_and_after(result.steps))
    if rollout == VLLM_CPU_ENGINE:
        problems = sync_check(result.steps, args.steps)
        print(problems or f"every step's rollout probabilities equal the actor's within {SYNC_TOLERANCE:g}")
        if problems:
            return 1
    return 0


def sync_check(steps: Mapping[int, Mapping[str, Any]], expected_steps: int) -> str:
    """'' when every training step logged rollout and actor probabilities within :data:`SYNC_TOLERANCE` of each
    other (the weights synced to the rollout are the actor's); else what failed. A stale or lost sync shows here."""
    missing = [step for step in range(1, expected_steps + 1) if SYNC_CHECK_KEY not in steps.get(step, {})]
    if missing:
        return f"steps {missing} logged no {SYNC_CHECK_KEY} (rollout.calculate_log_probs off?)"
    bad = {step: float(steps[step][SYNC_CHECK_KEY]) for step in range(1, expected_steps + 1)}
    bad = {step: diff for step, diff in bad.items() if not diff < SYNC_TOLERANCE}
    if bad:
        return (
            f"rollout and actor disagree after the weight sync: {SYNC_CHECK_KEY} {bad} (tolerance {SYNC_TOLERANCE:g})"
        )
    return ""


def vllm_servable(model: Path, workdir: Path) -> Path:
    """``model`` as vLLM's CPU attention serves it: itself when its heads are wide enough, else a head_dim-32 copy
    in ``workdir`` (:func:`.wide_heads.widen_heads`, the same function)."""
    import json

    from .wide_heads import VLLM_CPU_HEAD_SIZES, widen_heads

    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim in VLLM_CPU_HEAD_SIZES:
        return model
    return widen_heads(model, workdir / f"{model.name}-head32", head_dim=32)


def before_and_after(steps: Mapping[int, Mapping[str, Any]]) -> str:
    """One line: held-back success (and how often validation episodes browsed) at the first and last validation."""
    key = f"val-core/{DATA_SOURCE}/reward/mean@1"
    validated = sorted(step for step, metrics in steps.items() if key in metrics)
    if not validated:
        return "no validation ran (--test-freq)"
    first, last = validated[0], validated[-1]
    browsed = f"val-aux/{DATA_SOURCE}/env/browsed/mean@1"

    def at(step: int) -> str:
        share = steps[step].get(browsed)
        return f"{float(steps[step][key]):.3f}" + (
            f" ({float(share):.0%} of episodes browsed)" if share is not None else ""
        )

    return f"held-back success: {at(first)} at step {first} -> {at(last)} at step {last}"


def _step_printer(spec: RunSpec) -> Callable[[str], None]:
    """Prints the summary line of each step as soon as verl logs it (the metrics file has it by then)."""
    import re

    printed: set[int] = set()
    pattern = re.compile(r"\bstep:(\d+) - ")

    def on_line(line: str) -> None:
        match = pattern.search(line)
        if match is None:
            return
        step = int(match.group(1))
        metrics = read_step_metrics(spec.metrics_path).get(step)
        if metrics is not None and step not in printed:
            printed.add(step)
            print(summary_line(step, metrics), flush=True)

    return on_line


if __name__ == "__main__":
    raise SystemExit(main())
