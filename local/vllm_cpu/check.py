"""Does verl's own vLLM rollout serve a policy on CPU, and does a weight sync really change what it serves?

``python -m nemo_gym_browser.local.vllm_cpu.check --model DIR`` (run with ``.venv-vllm/bin/python``) starts a
private Ray on 127.0.0.1 and one verl ``vLLMHttpServer`` in hybrid mode on dummy weights, exactly as
``vLLMReplica.launch_servers`` would (the settings of :func:`~nemo_gym_browser.local.vllm_cpu.vllm_cpu_overrides`),
and drives it through verl's rollout adapter for ``vllm`` (this package's ``CpuServerAdapter``), with a Hugging Face
model of the same folder standing in for the actor:

1. sync the actor's weights; the server's log-probs of fixed token sequences (``prompt_logprobs``) and of tokens it
   samples itself must equal the actor's within :data:`LOGPROB_TOLERANCE`;
2. change the actor's weights (a deterministic perturbation, as a training step would); before any sync the
   server must now disagree (the check can fail), after the sync agree again;
3. a sync that changes nothing (the weights of step 1 sent while the actor holds step 2's) must make the check
   fail: that is what a reload that "succeeds" without taking effect looks like from outside;
4. a sync that fails on the server (a tensor of the wrong shape) must raise ``WeightSyncError`` within
   ``--sync-timeout`` seconds, never hang; a good sync afterwards brings the server back in line.

It prints one line per stage and, with ``--json FILE``, writes every figure. Exit status 0 when every stage held,
1 otherwise. Leaves nothing running (Ray is shut down; vLLM's engine processes end with it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# The one tolerance for "the same log-probs": float32 on CPU agreed to ~1e-5 here (vLLM's oneDNN GEMMs against
# transformers' sdpa); a stale or half-applied sync is off by ~1e-1 or more.
LOGPROB_TOLERANCE = 1e-3
PERTURBATION = 0.05  # relative size of the simulated training step; moves log-probs by ~0.1-1


def _environment(num_threads: int = 1) -> dict[str, str]:
    from . import vllm_cpu_env

    env = vllm_cpu_env(num_threads=num_threads)
    env.update({"RAY_DEDUP_LOGS": "0", "HYDRA_FULL_ERROR": "1"})
    return env


def compose_config(model: Path, *, max_model_len: int, overrides: Sequence[str] = ()) -> Any:
    """verl's whole trainer config (ppo_trainer.yaml with the CPU vLLM overrides, then ``overrides``), resolved."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from . import vllm_cpu_overrides

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    overrides = [
        *vllm_cpu_overrides(max_model_len=max_model_len),
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.prompt_length={max_model_len // 2}",
        f"actor_rollout_ref.rollout.response_length={max_model_len // 2}",
        "actor_rollout_ref.rollout.enable_prefix_caching=False",  # prompt_logprobs of repeated prompts
        *overrides,
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.resolve(config)
    return config


def compose_rollout_config(model: Path, *, max_model_len: int, overrides: Sequence[str] = ()) -> tuple[Any, Any]:
    """verl's rollout and model configs (:func:`compose_config`)."""
    config = compose_config(model, max_model_len=max_model_len, overrides=overrides)
    return config.actor_rollout_ref.rollout, config.actor_rollout_ref.model


SERVER_NAME = "vllm_server_0_0"  # what vLLMReplica names replica 0's server on node 0


async def launch_vllm_server(rollout_config: Any, model_config: Any, *, name: str = SERVER_NAME) -> Any:
    """One verl ``vLLMHttpServer`` in hybrid mode as a Ray actor, as ``vLLMReplica.launch_servers`` starts replica 0
    on one (logical) GPU; returns its handle once the server is up."""
    import ray
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    server = (
        ray.remote(vLLMHttpServer)
        .options(name=name, max_concurrency=1000)
        .remote(
            config=rollout_config,
            model_config=model_config,
            rollout_mode=RolloutMode.HYBRID,
            workers=[],
            replica_rank=0,
            node_rank=0,
            gpus_per_node=1,
            nnodes=1,
            cuda_visible_devices="0",
        )
    )
    await server.launch_server.remote()
    return server


def rollout_adapter(rollout_config: Any, model_config: Any, *, sync_timeout_s: float = 60.0) -> Any:
    """verl's rollout adapter for ``vllm`` as a trainer rank builds it (this package's ``CpuServerAdapter``, rank 0
    of one): ``await adapter.update_weights(iter(state_dict.items()), global_steps=N)`` syncs the server."""
    from verl.workers.rollout.base import get_rollout_class

    os.environ.update({"RANK": "0", "RAY_LOCAL_WORLD_SIZE": "1"})
    adapter = get_rollout_class("vllm", "async")(config=rollout_config, model_config=model_config, device_mesh=None)
    adapter.weight_sync_timeout_s = sync_timeout_s
    return adapter


@contextlib.contextmanager
def private_ray(*, num_cpus: int = 4, num_threads: int = 1) -> Iterator[None]:
    """The CPU vLLM environment in this process (``num_threads`` compute threads per process) and a private Ray on
    127.0.0.1 with one logical GPU; on the way out Ray is shut down (vLLM's engine processes end with it) and the
    /dev/shm segments they left are removed."""
    os.environ.update(_environment(num_threads))  # before verl, Ray and vLLM are imported: every process inherits it
    import ray

    from . import install, remove_orphaned_shm, wall_clock

    install()  # this package may have been imported before VERL_PLATFORM was set here
    started_wall = wall_clock()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=1,  # the logical GPU verl's cpu platform schedules on
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )
    try:
        yield
    finally:
        ray.shutdown()
        time.sleep(2)  # the engine processes end with their Ray worker
        removed = remove_orphaned_shm(started_wall)
        print(f"removed {len(removed)} shared-memory segments vLLM left in /dev/shm", flush=True)


class Stage:
    def __init__(self, name: str) -> None:
        self.name = name
        self.figures: dict[str, Any] = {}
        self.ok = False

    def line(self) -> str:
        figures = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.figures.items())
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {figures}"


def actor_logprobs(model: Any, sequences: list[list[int]]) -> list[list[float]]:
    """Log-prob of each token after the first of each sequence, under the actor (float32)."""
    import torch

    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append(logp.tolist())
    return out


async def server_prompt_logprobs(server: Any, sequences: list[list[int]], tag: str) -> list[list[float]]:
    """The server's log-prob of each token after the first of each sequence (vLLM's ``prompt_logprobs``)."""
    out = []
    for i, ids in enumerate(sequences):
        result = await server.generate.remote(
            prompt_ids=ids,
            sampling_params={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
            request_id=f"check-{tag}-{i}",
        )
        # verl pads one dummy entry for the last prompt token
        out.append([float(row[0]) for row in result.extra_fields["prompt_logprobs"][: len(ids) - 1]])
    return out


def max_gap(first: list[list[float]], second: list[list[float]]) -> float:
    return max(abs(a - b) for xs, ys in zip(first, second, strict=True) for a, b in zip(xs, ys, strict=True))


async def sampled_gap(server: Any, model: Any, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, int]:
    """Sample ``tokens`` per prompt on the server with its log-probs; the largest gap to the actor's, and the count."""
    gaps, count = [], 0
    for i, prompt in enumerate(prompts):
        result = await server.generate.remote(
            prompt_ids=prompt,
            sampling_params={"max_tokens": tokens, "temperature": 1.0, "logprobs": True, "ignore_eos": True},
            request_id=f"sample-{tag}-{i}",
        )
        full = prompt + list(result.token_ids)
        mine = actor_logprobs(model, [full])[0][len(prompt) - 1 :]
        gaps.append(max(abs(a - b) for a, b in zip(mine, result.log_probs, strict=True)))
        count += len(result.token_ids)
    return max(gaps), count


def perturb(model: Any, seed: int) -> dict[str, Any]:
    """Move every parameter of ``model`` (tied ones once) as a training step would; its new state dict."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():  # tied weights appear once here, twice in the state dict
            param.add_(PERTURBATION * param.abs().mean() * torch.randn(param.shape, generator=generator))
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


async def run_check(model_dir: Path, *, max_model_len: int, sync_timeout_s: float, seed: int) -> list[Stage]:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from . import WeightSyncError

    stages: list[Stage] = []
    rollout_config, model_config = compose_rollout_config(model_dir, max_model_len=max_model_len)

    stage = Stage("server up")
    stages.append(stage)
    started = time.monotonic()
    server = await launch_vllm_server(rollout_config, model_config)
    stage.figures["startup s"] = round(time.monotonic() - started, 1)
    stage.figures["address"] = ":".join(map(str, await server.get_server_address.remote()))
    stage.ok = True

    adapter = rollout_adapter(rollout_config, model_config, sync_timeout_s=sync_timeout_s)

    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    vocab = actor.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (16, 64, 200)]
    prompts = [seq[:12] for seq in sequences]

    async def sync(state: dict[str, Any], step: int) -> float:
        began = time.monotonic()
        await adapter.update_weights(iter(list(state.items())), global_steps=step)
        return time.monotonic() - began

    # 1. the actor's weights, synced
    stage = Stage("sync 1: served log-probs equal the actor's")
    stages.append(stage)
    step1 = {name: tensor.detach().clone() for name, tensor in actor.state_dict().items()}
    stage.figures["dummy-weight gap"] = max_gap(
        await server_prompt_logprobs(server, sequences, "dummy"), actor_logprobs(actor, sequences)
    )
    stage.figures["sync s"] = round(await sync(step1, 1), 2)
    stage.figures["fixed-token gap"] = max_gap(
        await server_prompt_logprobs(server, sequences, "s1"), actor_logprobs(actor, sequences)
    )
    stage.figures["sampled gap"], stage.figures["sampled tokens"] = await sampled_gap(server, actor, prompts, 32, "s1")
    stage.ok = stage.figures["fixed-token gap"] < LOGPROB_TOLERANCE and stage.figures["sampled gap"] < LOGPROB_TOLERANCE

    # 2. a training step's change, not yet synced, then synced
    stage = Stage("sync 2: the change of a step reaches the server")
    stages.append(stage)
    step2 = perturb(actor, seed + 1)
    stage.figures["gap before sync"] = max_gap(
        await server_prompt_logprobs(server, sequences, "pre2"), actor_logprobs(actor, sequences)
    )
    stage.figures["sync s"] = round(await sync(step2, 2), 2)
    stage.figures["gap after sync"] = max_gap(
        await server_prompt_logprobs(server, sequences, "s2"), actor_logprobs(actor, sequences)
    )
    stage.figures["sampled gap"], _ = await sampled_gap(server, actor, prompts, 32, "s2")
    stage.ok = (
        stage.figures["gap before sync"] > LOGPROB_TOLERANCE
        and stage.figures["gap after sync"] < LOGPROB_TOLERANCE
        and stage.figures["sampled gap"] < LOGPROB_TOLERANCE
    )

    # 3. a sync that changes nothing must fail the check
    stage = Stage("sync 3: a sync that changes nothing fails the check")
    stages.append(stage)
    stage.figures["sync s"] = round(await sync(step1, 3), 2)  # the server serves step 1 again; the actor holds step 2
    stage.figures["gap"] = max_gap(
        await server_prompt_logprobs(server, sequences, "s3"), actor_logprobs(actor, sequences)
    )
    stage.ok = stage.figures["gap"] > LOGPROB_TOLERANCE

    # 4. a sync the server cannot load raises, in bounded time; a good one afterwards restores agreement
    stage = Stage("sync 4: a failed sync raises, never hangs")
    stages.append(stage)
    broken = dict(step2)
    norm = next(name for name in broken if name.endswith("norm.weight"))
    broken[norm] = torch.ones(broken[norm].numel() + 1)
    began = time.monotonic()
    try:
        await asyncio.wait_for(adapter.update_weights(iter(list(broken.items())), global_steps=4), sync_timeout_s * 2)
        stage.figures["raised"] = "nothing"
    except WeightSyncError as exc:
        stage.figures["raised"] = "WeightSyncError"
        stage.figures["error"] = str(exc).splitlines()[0][:160]
    except TimeoutError:
        stage.figures["raised"] = "timeout (hung)"
    stage.figures["s to raise"] = round(time.monotonic() - began, 1)
    stage.figures["resync s"] = round(await sync(step2, 5), 2)
    stage.figures["gap after resync"] = max_gap(
        await server_prompt_logprobs(server, sequences, "s5"), actor_logprobs(actor, sequences)
    )
    stage.ok = stage.figures["raised"] == "WeightSyncError" and stage.figures["gap after resync"] < LOGPROB_TOLERANCE

    ray.kill(server)
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.vllm_cpu.check",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, required=True, help="a model folder vLLM's CPU build serves")
    parser.add_argument("--max-model-len", type=int, default=512, help="default %(default)s")
    parser.add_argument("--sync-timeout", type=float, default=60.0, help="seconds a silent sync may wait (60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the stages and figures here")
    args = parser.parse_args(argv)

    started = time.monotonic()
    with private_ray():
        stages = asyncio.run(
            run_check(args.model.resolve(), max_model_len=args.max_model_len, sync_timeout_s=args.sync_timeout,
                      seed=args.seed)
        )  # fmt: skip
    for stage in stages:
        print(stage.line(), flush=True)
    ok = all(stage.ok for stage in stages) and len(stages) == 5
    print(f"{'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s (tolerance {LOGPROB_TOLERANCE:g})")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"ok": ok, "tolerance": LOGPROB_TOLERANCE, "stages": [vars(s) for s in stages]}, indent=2
            ) + "\n"
        )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
