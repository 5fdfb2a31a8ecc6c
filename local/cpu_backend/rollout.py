"""The ``hfcpu`` rollout backend: verl's replica and in-worker adapter around :class:`server.HFCpuServer`.

A stand-in for vLLM for tests, CI and the local rehearsal; the replica refuses to start unless verl runs on the
``cpu`` platform (or ``NEMO_GYM_BROWSER_CPU_BACKEND_FORCE=1``).

Contract, as verl 0.9.1 splits a rollout backend: :class:`HFCpuReplica` (registry name ``hfcpu``) starts one
:class:`HFCpuServer` Ray actor per replica, ``hfcpu_server_<replica_rank>``, in hybrid mode only (standalone and
colocated replicas raise); calls the server does not have (``wake_up``, the kv-cache calls of non-naive checkpoint
engines and reward-model replicas) fail loudly. :class:`HFCpuServerAdapter` (``("hfcpu", "async")``) is the
``BaseRollout`` in each actor worker: every rank drains ``update_weights``' generator of full tensors and the
replica's first rank sends them to its server with ``global_steps``. Details:
``docs/rehearsal-and-cpu-training.md#the-cpu-backend-in-detail``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import ray
import torch
from verl.utils.device import get_device_name
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry
from verl.workers.rollout.utils import ensure_async_iterator

# Modules, not names: this module may be imported while one of these is still initialising (see plugin.py).
from . import FORCE_ENV, PLATFORM_NAME, ROLLOUT_NAME
from . import platform as cpu_platform
from . import server as hfcpu_server

logger = logging.getLogger(__name__)

# Loading weights from disk (a non-dummy load_format) and sending a whole model through Ray both scale with its size;
# these bound a stuck server, not a slow one.
SERVER_START_TIMEOUT_S = 600.0
WEIGHT_UPDATE_TIMEOUT_S = 600.0

__all__ = ["HFCpuReplica", "HFCpuServerAdapter", "register", "server_actor_name", "start_server_actor"]


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    return f"{ROLLOUT_NAME}_server_{replica_rank}{name_suffix}"


def start_server_actor(
    config: Any, model_config: Any, replica_rank: int, *, name: str, max_concurrency: int = 1000
) -> ray.actor.ActorHandle:
    """Start one ``server.HFCpuServer`` as a named Ray actor (the caller awaits ``describe`` to know it is up)."""
    threads = str(hfcpu_server.server_settings(config).num_threads)
    return (
        ray.remote(hfcpu_server.HFCpuServer)
        .options(
            name=name,
            num_cpus=0,
            max_concurrency=max_concurrency,
            # Read by OpenMP/MKL at process start; torch.set_num_threads in the server covers the rest.
            runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}},
        )
        .remote(config, model_config, replica_rank)
    )


class HFCpuReplica(RolloutReplica):
    """One ``hfcpu`` server per replica, in hybrid mode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cpu_platform.refuse_on_cuda_host("the hfcpu rollout")
        if get_device_name() != PLATFORM_NAME and os.environ.get(FORCE_ENV) != "1":
            raise RuntimeError(
                f"the hfcpu rollout runs with verl's '{PLATFORM_NAME}' platform only (VERL_PLATFORM={PLATFORM_NAME}); "
                f"this process runs '{get_device_name()}'"
            )

    async def launch_servers(self) -> None:
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(
                f"the hfcpu rollout supports hybrid replicas (actor and rollout colocated), not {self.rollout_mode}"
            )
        name = server_actor_name(self.replica_rank, self.name_suffix)
        handle = start_server_actor(
            self.config, self.model_config, self.replica_rank, name=name, max_concurrency=self.max_concurrency
        )
        description = await asyncio.wait_for(handle.describe.remote(), SERVER_START_TIMEOUT_S)
        logger.info("hfcpu replica %d: server %s up: %s", self.replica_rank, name, description)
        self.servers = [handle]
        self._server_handle = handle
        # Not a URL: the server speaks Ray calls only (no OpenAI-compatible HTTP endpoint).
        self._server_address = name

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """Abort one request on this replica's server (as ``vLLMReplica.abort_request``)."""
        return await self._server_handle.abort_request.remote(request_id)


class HFCpuServerAdapter(BaseRollout):
    """The rollout inside an actor worker: forwards the actor's weights to its replica's server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_sender = rank % world == 0
        self._server: ray.actor.ActorHandle | None = None

    def _server_handle(self) -> ray.actor.ActorHandle:
        # Looked up lazily: verl builds this adapter before it launches the replicas.
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        """Nothing to bring back: ``sleep`` released no weights or cache."""

    async def release(self) -> None:
        """Nothing to release on CPU (verl 0.9.1's trainers never call this)."""

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hfcpu rollout takes full named tensors, not wire_format={wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("the hfcpu rollout takes merged weights: set actor_rollout_ref.model.lora.merge")
        state_dict: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.is_sender:
                state_dict[name] = full.detach().to("cpu", copy=True)
        if not self.is_sender:
            return
        summary = await asyncio.wait_for(
            self._server_handle().update_weights.remote(state_dict, global_steps=global_steps), WEIGHT_UPDATE_TIMEOUT_S
        )
        logger.info("hfcpu replica %d: weights updated: %s", self.replica_rank, summary)


def register() -> None:
    """Make ``actor_rollout_ref.rollout.name=hfcpu`` resolvable in this process (idempotent)."""
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFCpuReplica)
    # verl 0.9.1 has no register function for adapters: the registry is a module-level dict of import paths.
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.{HFCpuServerAdapter.__name__}"


register()
