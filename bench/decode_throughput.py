"""Tokens per second of the ``hfcpu`` rollout server: one request at a time against the requests decoded together.

The server runs in this process with the settings ``main_ppo`` gives it on CPU. For each model shape (``tiny``, the
project's policy; ``larger``, a 4-layer, 256-wide Qwen2) and each concurrency, that many requests are sent at once,
each with its own prompt of ``--prompt-tokens`` random ids and ``--max-tokens`` to generate at temperature 1
(``ignore_eos``), to a fresh ``serial`` server (``max_batch_size=1``) and a fresh ``batched`` one (``max_batch_size``
= the concurrency). A figure is generated tokens over the wall time from the first request to the last answer,
prefills included; ``same`` counts the requests whose tokens agree between the two (each request has its own seeded
stream). Method in full: ``docs/benchmarks.md#cpu-rollout-decoding``.

examples:
    python bench/decode_throughput.py                                  # tiny and larger, 1 / 16 / 64 requests
    python bench/decode_throughput.py --shapes tiny --concurrency 1 16 --max-tokens 32
    python bench/decode_throughput.py --threads 2 --json /tmp/decode_throughput.json

exit codes: 0 measured, 2 usage error
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from verl.workers.config import RolloutConfig

from nemo_gym_browser.local import policy_model
from nemo_gym_browser.local.cpu_backend import ROLLOUT_NAME
from nemo_gym_browser.local.cpu_backend.server import HFCpuServer
from nemo_gym_browser.testing.benchmarking import describe_machine, header

HERE = Path(__file__).resolve().parent
SHAPES = {
    "tiny": policy_model.ModelSpec(),
    "larger": policy_model.ModelSpec(
        hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024
    ),
}
MODES = ("serial", "batched")
CALL_TIMEOUT_S = 3600.0  # a whole wave of requests on the slow path; bounds a hung server, not a slow one


@dataclass(frozen=True)
class Row:
    shape: str
    parameters: int
    concurrency: int
    serial_tokens_per_s: float
    batched_tokens_per_s: float
    same: int

    @property
    def ratio(self) -> float:
        return self.batched_tokens_per_s / self.serial_tokens_per_s


def write_policy(folder: Path, spec: policy_model.ModelSpec, seed: int) -> int:
    """A seeded, untrained model of this shape with the policy's tokenizer (throughput does not need training)."""
    tokenizer = policy_model.policy_tokenizer()
    model = policy_model.build_model(tokenizer, spec, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return policy_model.parameter_count(model)


def prompts_for(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def make_server(folder: Path, max_batch_size: int, threads: int, seed: int) -> HFCpuServer:
    config = RolloutConfig(
        name=ROLLOUT_NAME,
        prompt_length=policy_model.PROMPT_LENGTH,
        response_length=policy_model.RESPONSE_LENGTH,
        tensor_model_parallel_size=1,
        dtype="float32",
        load_format="auto",
        seed=seed,
        engine_kwargs={ROLLOUT_NAME: {"num_threads": threads, "max_batch_size": max_batch_size}},
    )
    return HFCpuServer(config, {"path": str(folder), "override_config": {"attn_implementation": "sdpa"}})


async def wave(server: HFCpuServer, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Send every prompt at once; the wall time until the last answer, and the answers in prompt order."""
    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    started = time.perf_counter()
    outputs = await asyncio.wait_for(
        asyncio.gather(*(server.generate(prompt, params, f"bench-{i}") for i, prompt in enumerate(prompts))),
        CALL_TIMEOUT_S,
    )
    return time.perf_counter() - started, [out.token_ids for out in outputs]


async def measure(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, float, int]:
    rates, tokens = {}, {}
    for mode in MODES:
        server = make_server(folder, 1 if mode == "serial" else len(prompts), args.threads, args.seed)
        await wave(server, [prompts[0][:16]], 4)  # warm-up: first-call allocations, kernel selection
        seconds, tokens[mode] = await wave(server, prompts, args.max_tokens)
        rates[mode] = len(prompts) * args.max_tokens / seconds
    same = sum(a == b for a, b in zip(tokens["serial"], tokens["batched"], strict=True))
    return rates["serial"], rates["batched"], same


def format_row(row: Row) -> str:
    return (
        f"{row.shape:<7} {row.parameters:>10,d} {row.concurrency:>8d} {row.serial_tokens_per_s:>11.1f} "
        f"{row.batched_tokens_per_s:>12.1f} {row.ratio:>7.2f}x {row.same:>4d}/{row.concurrency}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("examples:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "larger"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="requests sent at once")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs=2, default=[600, 1500], metavar=("MIN", "MAX"), help="prompt lengths"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="the server's num_threads (default 1, as main_ppo)")
    parser.add_argument("--seed", type=int, default=0, help="model, prompts and rollout.seed")
    parser.add_argument("--json", type=Path, default=HERE / "decode_throughput.json", help="where the figures go")
    args = parser.parse_args(argv)
    low, high = args.prompt_tokens
    problem = None
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.threads < 1 or not 1 <= low <= high:
        problem = "--concurrency, --max-tokens and --threads must be positive, --prompt-tokens MIN <= MAX"
    elif high + args.max_tokens > policy_model.PROMPT_LENGTH + policy_model.RESPONSE_LENGTH:
        problem = "--prompt-tokens MAX plus --max-tokens exceeds the tiny policy's context"
    if problem:
        print(f"decode_throughput.py: error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(header("decode throughput of the hfcpu rollout server: serial vs batched"), flush=True)
    print(
        f"prompts {low}-{high} tokens, {args.max_tokens} generated per request, temperature 1, "
        f"{args.threads} decode thread(s)"
    )
    columns = ("shape", "parameters", "requests", "serial tok/s", "batched tok/s", "ratio")
    print("{:<7} {:>10} {:>8} {:>11} {:>12} {:>8}  same".format(*columns))
    rows = []
    with tempfile.TemporaryDirectory(prefix="decode-throughput-") as workdir:
        for shape in args.shapes:
            folder = Path(workdir) / shape
            parameters = write_policy(folder, SHAPES[shape], args.seed)
            vocab = len(policy_model.policy_tokenizer())
            for concurrency in args.concurrency:
                prompts = prompts_for(concurrency, (low, high), vocab, args.seed)
                serial, batched, same = asyncio.run(measure(folder, prompts, args))
                rows.append(Row(shape, parameters, concurrency, serial, batched, same))
                print(format_row(rows[-1]), flush=True)
    report = {
        "machine": asdict(describe_machine()),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "shapes": {shape: asdict(SHAPES[shape]) for shape in args.shapes},
        "rows": [asdict(row) | {"ratio": round(row.ratio, 3)} for row in rows],
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
