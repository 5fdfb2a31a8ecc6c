"""Does the recipe's deadline cancellation reach verl's vLLM server on CPU, and does its tool-call parser read what
vLLM generates?

``python -m nemo_gym_browser.local.vllm_cpu.loop_check --model DIR`` (``.venv-vllm/bin/python``; ``DIR`` a policy
vLLM's CPU build serves) starts a private Ray on 127.0.0.1 and one verl ``vLLMHttpServer`` as :mod:`.check` does,
syncs the weights through verl's rollout adapter, and reaches it as the agent loop does: verl's ``LLMServerClient``
behind verl's load balancer. Stages (``--stages``, all by default): ``client`` (:func:`track_rollout_requests`
accepts that client); ``cancel`` (a long request cut after ``--cut`` seconds by a plain ``asyncio.wait_for``, the
control, then by :func:`generate_within`, the server sampled every :data:`SAMPLE_EVERY_S` from inside and outside
its process: holds when the control keeps decoding and the cut request leaves the engine within
:data:`STOP_WITHIN_S`, the token counter then still); ``tools`` (deal-task episodes through the real
``BrowserToolAgentLoop``, every turn parsed by the recipe's parser and by plain JSON alike, the first greedy turn
equal token by token to the Hugging Face model's).

It prints one line per stage and, with ``--json FILE``, every figure and the sampled traces. Exit status 0 when
every stage held, 1 otherwise. Leaves nothing running. What it measured: ``docs/vllm-on-cpu.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .check import Stage, compose_config, launch_vllm_server, private_ray, rollout_adapter

SAMPLE_EVERY_S = 0.2
# A cut request must have left vLLM's engine this soon after generate_within raised.
STOP_WITHIN_S = 2.0
STAGES = ("client", "cancel", "tools")
# The vLLM gauges and counter read from the server process's Prometheus registry.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTER = "vllm:generation_tokens_total"


# ----- what the server holds, read in its own process (Ray's __ray_call__ runs a function on the actor instance)


def _server_state(server: Any) -> dict[str, Any]:
    """In the server actor: vLLM's in-flight requests with their generated-token counts, its Prometheus figures, and
    the pids of the actor and its descendants (the engine core)."""
    import prometheus_client

    requests = {
        request_id: state.detokenizer.num_output_tokens() if state.detokenizer is not None else -1
        for request_id, state in server.engine.output_processor.request_states.items()
    }
    metrics = {}
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name in (*GAUGES, COUNTER):
                metrics[sample.name] = metrics.get(sample.name, 0.0) + float(sample.value)
    return {"pid": os.getpid(), "requests": requests, "metrics": metrics}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of these processes (those still alive)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


async def server_sample(server: Any, pids: list[int], since: float) -> dict[str, Any]:
    state = await server.__ray_call__.remote(_server_state)
    return {
        "t": round(time.monotonic() - since, 3),
        "requests": state["requests"],
        "tokens": sum(state["requests"].values()),
        **{name.split(":")[1]: value for name, value in state["metrics"].items()},
        "cpu_s": round(cpu_seconds(pids), 3),
    }


async def watch(server: Any, pids: list[int], since: float, seconds: float) -> list[dict[str, Any]]:
    trace = []
    while time.monotonic() - since < seconds:
        trace.append(await server_sample(server, pids, since))
        await asyncio.sleep(SAMPLE_EVERY_S)
    return trace


# ----- the server, synced, behind verl's own client


class Served:
    """One vLLM server with the policy's weights, verl's load balancer and client in front of it."""

    def __init__(self, server: Any, client: Any, config: Any, actor: Any, tokenizer: Any, pids: list[int]) -> None:
        self.server, self.client, self.config, self.actor, self.tokenizer, self.pids = (
            server,
            client,
            config,
            actor,
            tokenizer,
            pids,
        )


async def serve(model_dir: Path, *, max_model_len: int, figures: dict[str, Any]) -> Served:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    config = compose_config(
        model_dir, max_model_len=max_model_len, overrides=["actor_rollout_ref.rollout.disable_log_stats=False"]
    )
    rollout_config, model_config = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    started = time.monotonic()
    server = await launch_vllm_server(rollout_config, model_config)
    figures["startup s"] = round(time.monotonic() - started, 1)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    adapter = rollout_adapter(rollout_config, model_config)
    began = time.monotonic()
    await adapter.update_weights(iter(list(actor.state_dict().items())), global_steps=1)
    figures["sync s"] = round(time.monotonic() - began, 2)
    address = ":".join(map(str, await server.get_server_address.remote()))
    balancer = get_router_handle(servers={address: server}, full_determinism=False)
    client = LLMServerClient(config=config, load_balancer_handle=balancer)
    pid = (await server.__ray_call__.remote(_server_state))["pid"]
    pids = _descendants(pid)
    figures["server processes"] = len(pids)
    return Served(server, client, config, actor, AutoTokenizer.from_pretrained(model_dir), pids)


# ----- the stages


def stage_client(served: Served) -> Stage:
    from nemo_gym_browser.agent_attempt.rollout_cancel import check_acquire_server, track_rollout_requests

    stage = Stage("client: rollout_cancel tracks verl's client on the vllm path")
    client = served.client
    stage.figures["client"] = f"{type(client).__module__}.{type(client).__qualname__}"
    stage.figures["rollout"] = served.config.actor_rollout_ref.rollout.name
    check_acquire_server(client)  # raises RolloutCancelUnsupported on a verl that drifted
    stage.figures["tracked"] = track_rollout_requests(client)
    stage.ok = stage.figures["tracked"] is True and stage.figures["rollout"] == "vllm"
    return stage


async def _settle(server: Any, pids: list[int], limit_s: float) -> bool:
    """Wait until the engine holds no request (at most ``limit_s``); whether it got there."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        sample = await server_sample(server, pids, began)
        if not sample["requests"] and not sample.get("num_requests_running"):
            return True
        await asyncio.sleep(SAMPLE_EVERY_S)
    return False


def _summarise(trace: list[dict[str, Any]], max_tokens: int, counter_before: float) -> dict[str, Any]:
    """What a trace after a cut shows: the tokens generated before the cut and after it (vLLM's counter, which was
    ``counter_before`` when the request was sent), when the request left the engine, and what the engine did after
    that."""
    first, last = trace[0], trace[-1]
    gone = next((s for s in trace if not s["requests"] and not s.get("num_requests_running")), None)
    tracked = [s["tokens"] for s in trace if s["requests"]]
    summary: dict[str, Any] = {
        "generated before cut": round(first["generation_tokens_total"] - counter_before),
        "generated after cut": round(last["generation_tokens_total"] - first["generation_tokens_total"]),
        "tokens at cut": first["tokens"],
        "tokens last seen": tracked[-1] if tracked else first["tokens"],
        "max tokens": max_tokens,
        "left engine after s": gone["t"] if gone else None,
        "engine cpu s after cut": round(last["cpu_s"] - first["cpu_s"], 2),
        "watched s": last["t"],
    }
    if gone is not None:
        summary["counter growth after leaving"] = round(
            last["generation_tokens_total"] - gone["generation_tokens_total"]
        )
        summary["engine cpu s after leaving"] = round(last["cpu_s"] - gone["cpu_s"], 2)
        summary["s after leaving"] = round(last["t"] - gone["t"], 2)
    return summary


async def stage_cancel(served: Served, *, cut_s: float, watch_s: float, seed: int) -> tuple[Stage, dict[str, Any]]:
    from nemo_gym_browser.agent_attempt.rollout_cancel import generate_within

    stage = Stage("cancel: a generation cut by generate_within stops decoding on the vLLM server")
    server, client, pids = served.server, served.client, served.pids
    rng = random.Random(seed)
    prompt = [rng.randrange(3, served.actor.config.vocab_size) for _ in range(64)]
    max_tokens = served.config.actor_rollout_ref.rollout.max_model_len - len(prompt)
    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    traces: dict[str, Any] = {}

    async def cut(kind: str) -> tuple[float, float]:
        counter_before = (await server_sample(server, pids, time.monotonic())).get("generation_tokens_total", 0.0)
        generation = client.generate(request_id=f"cancel-{kind}", prompt_ids=prompt, sampling_params=dict(params))
        began = time.monotonic()
        try:
            if kind == "control":
                await asyncio.wait_for(generation, cut_s)  # cancels the awaiting task only
            else:
                await generate_within(generation, cut_s, f"loop_check {kind}")
            raise AssertionError(f"the {kind} request finished within {cut_s} s: make it longer")
        except TimeoutError:
            pass
        return began + cut_s, counter_before

    # A short request first: the load balancer actor and the engine's first-request costs are not the cut's.
    began = time.monotonic()
    await client.generate(request_id="warm-up", prompt_ids=prompt, sampling_params={**params, "max_tokens": 8})
    stage.figures["warm-up s"] = round(time.monotonic() - began, 2)
    assert await _settle(server, pids, 30.0), "the server was busy before the stage"
    at, before = await cut("control")
    traces["control"] = await watch(server, pids, at, watch_s)
    control = _summarise(traces["control"], max_tokens, before)
    # Let the control finish or end it (verl's own abort) before the real cut, so the engine holds one request.
    settled = await _settle(server, pids, 60.0)
    if not settled:
        for request_id in traces["control"][-1]["requests"]:
            await server.abort_request.remote(request_id)
        settled = await _settle(server, pids, 10.0)
    at, before = await cut("generate_within")
    traces["cut"] = await watch(server, pids, at, watch_s)
    cancelled = _summarise(traces["cut"], max_tokens, before)
    stage.figures.update(
        {
            "cut s": cut_s,
            "max tokens": max_tokens,
            "control generated before cut": control["generated before cut"],
            "control generated after cut": control["generated after cut"],
            "control left engine after s": control["left engine after s"],
            "control engine cpu s after cut": control["engine cpu s after cut"],
            "cut generated before cut": cancelled["generated before cut"],
            "cut generated after cut": cancelled["generated after cut"],
            "cut left engine after s": cancelled["left engine after s"],
            "cut engine cpu s after cut": cancelled["engine cpu s after cut"],
            "watched s": watch_s,
        }
    )
    left = cancelled["left engine after s"]
    stage.ok = (
        control["generated after cut"] > 0  # the control went on decoding for nobody
        and cancelled["generated before cut"] > 0  # the cut request was decoding when it was cut
        and left is not None
        and left <= STOP_WITHIN_S
        and cancelled.get("counter growth after leaving") == 0
        and settled
    )
    return stage, {"control": control, "cut": cancelled, "traces": traces}


def independent_calls(text: str) -> list[tuple[str, Any]] | None:
    """The calls in a decoded turn read without the recipe's parser: each ``<tool_call>`` block as JSON; None when
    a block does not parse."""
    calls = []
    for block in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL):
        try:
            payload = json.loads(block)
        except json.JSONDecodeError:
            return None
        calls.append((payload.get("name"), payload.get("arguments")))
    return calls


async def stage_tools(served: Served, *, episodes: int, seed: int) -> tuple[Stage, dict[str, Any]]:
    import torch
    from verl.workers.rollout.llm_server import LLMServerClient

    from nemo_gym_browser.agent_attempt.tool_parser import LenientHermesToolParser
    from nemo_gym_browser.browser_agent_loop import close_shared_clients
    from nemo_gym_browser.local import shop_tasks, warm_start
    from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
    from nemo_gym_browser.local.in_process_loop import build_loop, compose_trainer_config, load_tools
    from nemo_gym_browser.local.policy_evaluation import ACTIONS, MAX_TURN_TOKENS, is_tool_call
    from nemo_gym_browser.local.policy_model import PROMPT_LENGTH, RESPONSE_LENGTH

    stage = Stage("tools: the recipe's hermes parser reads vLLM's tool calls")
    turns: list[dict[str, Any]] = []

    class RecordingClient(LLMServerClient):
        """verl's client, noting each turn's prompt and the token ids vLLM returned."""

        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kw):
            output = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kw)
            turns.append(
                {"prompt_ids": list(prompt_ids), "token_ids": list(output.token_ids), "params": dict(sampling_params)}
            )
            return output

    client = RecordingClient(config=served.config, load_balancer_handle=served.client._load_balancer)
    tokenizer = served.tokenizer
    with tempfile.TemporaryDirectory(prefix="loop-check-") as workdir:
        samples = warm_start.load_samples(shop_tasks.SUITE_FILES["deal"][1], Path(workdir))
    random.Random(seed).shuffle(samples)
    config = compose_trainer_config(
        prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH,
        overrides=["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=8"],
    )
    tools = load_tools()
    outcomes = []
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_TURN_TOKENS}
    try:
        async with InProcessEnvironmentServer(site=shop_tasks.in_process_site()) as environment:
            for sample in samples[:episodes]:
                loop = build_loop(
                    client, tokenizer=tokenizer, tools=tools, trainer_config=config,
                    environment={"server_urls": [environment.url]},
                )  # fmt: skip
                output = await loop.run(dict(sampling), **sample)
                outcomes.append(
                    {
                        "reward": output.reward_score,
                        "browser_actions": int(output.extra_fields.get("env_browser_actions", 0)),
                        "invalid": bool(output.extra_fields.get("env_invalid")),
                    }
                )
    finally:
        await close_shared_clients()

    parser = LenientHermesToolParser(tokenizer)
    with_calls = agree = browser_calls = well_formed = 0
    actions: dict[str, int] = {}
    examples, disagreements = [], []
    for turn in turns:
        text = tokenizer.decode(turn["token_ids"])
        _, calls = await parser.extract_tool_calls(turn["token_ids"])
        mine = [(call.name, json.loads(call.arguments)) for call in calls if _is_json(call.arguments)]
        theirs = independent_calls(text)
        with_calls += bool(calls)
        well_formed += is_tool_call(tokenizer.decode(turn["token_ids"], skip_special_tokens=True))
        if theirs is not None and mine == theirs and len(mine) == len(calls):
            agree += 1
        else:
            disagreements.append({"text": text, "parsed": [(c.name, c.arguments) for c in calls]})
        for name, args in mine:
            if name == "browser" and isinstance(args, dict) and args.get("action") in ACTIONS:
                browser_calls += 1
                actions[args["action"]] = actions.get(args["action"], 0) + 1
        if len(examples) < 4 and calls:
            examples.append(
                {"token_ids": turn["token_ids"], "text": text, "calls": [(c.name, c.arguments) for c in calls]}
            )

    # The first turn of the first episode, greedy: vLLM's tokens against the Hugging Face model's argmax.
    first = turns[0]
    greedy = await served.client.generate(
        request_id="greedy", prompt_ids=first["prompt_ids"], sampling_params={**first["params"], "temperature": 0.0}
    )
    ids = first["prompt_ids"] + list(greedy.token_ids)
    with torch.no_grad():
        logits = served.actor(input_ids=torch.tensor([ids])).logits[0, len(first["prompt_ids"]) - 1 : -1]
    same_argmax = int((logits.argmax(-1) == torch.tensor(greedy.token_ids)).sum())
    _, greedy_calls = await parser.extract_tool_calls(list(greedy.token_ids))

    stage.figures.update(
        {
            "episodes": len(outcomes),
            "turns": len(turns),
            "turns with calls": with_calls,
            "well-formed browser turns": well_formed,
            "parser agrees": agree,
            "browser calls": browser_calls,
            "actions": ", ".join(f"{action} {count}" for action, count in sorted(actions.items())),
            "episodes that browsed": sum(o["browser_actions"] > 0 for o in outcomes),
            "episodes answered": sum(o["reward"] is not None and not o["invalid"] for o in outcomes),
            "success": round(sum(o["reward"] or 0.0 for o in outcomes) / max(len(outcomes), 1), 3),
            "greedy tokens": len(greedy.token_ids),
            "greedy tokens = HF argmax": same_argmax,
            "greedy call": f"{greedy_calls[0].name} {greedy_calls[0].arguments}" if greedy_calls else "none",
        }
    )
    stage.ok = (
        len(turns) >= episodes
        and agree == len(turns)
        and with_calls >= 0.9 * len(turns)
        and browser_calls >= with_calls
        and same_argmax == len(greedy.token_ids)
        and bool(greedy_calls)
    )
    return stage, {"outcomes": outcomes, "examples": examples, "disagreements": disagreements[:8]}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


async def run(args: argparse.Namespace) -> tuple[list[Stage], dict[str, Any]]:
    details: dict[str, Any] = {}
    up = Stage("server up")
    stages = [up]
    served = await serve(args.model.resolve(), max_model_len=args.max_model_len, figures=up.figures)
    up.ok = True
    try:
        if "client" in args.stages or "cancel" in args.stages:
            stages.append(stage_client(served))
        if "cancel" in args.stages:
            stage, details["cancel"] = await stage_cancel(served, cut_s=args.cut, watch_s=args.watch, seed=args.seed)
            stages.append(stage)
        if "tools" in args.stages:
            stage, details["tools"] = await stage_tools(served, episodes=args.episodes, seed=args.seed)
            stages.append(stage)
    finally:
        import ray

        ray.kill(served.server)
    return stages, details


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.vllm_cpu.loop_check",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, required=True, help="a model folder vLLM's CPU build serves")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--max-model-len", type=int, default=4096, help="also the cancel stage's request length")
    parser.add_argument("--cut", type=float, default=1.5, help="seconds before the cancel stage cuts a request")
    parser.add_argument("--watch", type=float, default=5.0, help="seconds the server is watched after a cut (5)")
    parser.add_argument("--episodes", type=int, default=32, help="deal-task episodes of the tools stage (32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the stages, figures and traces here")
    args = parser.parse_args(argv)
    if args.cut <= 0 or args.watch <= STOP_WITHIN_S or args.episodes < 1 or args.max_model_len < 1024:
        parser.error(f"--cut and --episodes must be positive, --watch over {STOP_WITHIN_S}, --max-model-len >= 1024")

    started = time.monotonic()
    with private_ray():
        stages, details = asyncio.run(run(args))
    for stage in stages:
        print(stage.line(), flush=True)
    wanted = 1 + len({"client", *args.stages} if "cancel" in args.stages else set(args.stages))
    ok = all(stage.ok for stage in stages) and len(stages) == wanted
    print(f"{'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s")
    if args.json is not None:
        report = {"ok": ok, "stages": [vars(stage) for stage in stages], "details": details}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
