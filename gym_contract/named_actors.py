"""One named Ray actor per run (and role), found or created by whichever process needs it first.

What this module owns
    How the recipe's shared state actors (:mod:`placement`'s session-placement authority, :mod:`dropped_rollouts`'
    ledger) are named, created and found, so that every process of one run (the trainer, every ``AgentLoopWorker``,
    on every node) reaches the same actor and two runs sharing a Ray cluster never do.

What it guarantees
    * One actor per ``(run, role[, node])``: the name holds the Ray job id, which the driver of ``main_ppo`` and
      every actor it starts share; ``get_if_exists`` makes concurrent first calls from several processes agree.
    * The actor outlives the process that happened to create it (``lifetime="detached"``): a worker that dies does
      not take the run's shared state with it. It lives in the fixed namespace :data:`NAMESPACE` (so Ray does not
      warn about detached actors in anonymous namespaces) and ends itself once its owner class says it is idle
      (:func:`exit_when_idle`), or with the Ray cluster.
    * A node-scoped actor (``node_id``) is pinned to that node, next to its callers.

Nothing here imports Ray at module import: callers that run without Ray never load it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

NAMESPACE = "nemo_gym_browser"

_lock = threading.Lock()
_handles: dict[str, Any] = {}


def ray_connected() -> bool:
    """Whether this process is connected to Ray (a Ray worker, or a driver after ``ray.init``). Never imports Ray."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def in_actor() -> bool:
    """Whether this code runs inside a Ray actor (the shared-state classes are also used as plain objects)."""
    if not ray_connected():
        return False
    import ray

    return ray.get_runtime_context().get_actor_id() is not None


def actor_name(role: str, node_id: str | None = None) -> str:
    import ray

    name = f"{role}.job-{ray.get_runtime_context().get_job_id()}"
    return f"{name}.node-{node_id}" if node_id else name


def job_actor(
    cls: type,
    role: str,
    *,
    node_id: str | None = None,
    max_concurrency: int | None = None,
) -> Any:
    """The run's actor of ``role`` (one per node when ``node_id`` is given), creating it on first use."""
    import ray

    name = actor_name(role, node_id)
    with _lock:
        handle = _handles.get(name)
        if handle is not None:
            return handle
        remote_options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if max_concurrency is not None:
            remote_options["max_concurrency"] = max_concurrency
        options: dict[str, Any] = {
            "name": name,
            "namespace": NAMESPACE,
            "get_if_exists": True,
            "lifetime": "detached",
        }
        if node_id:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        handle = ray.remote(**remote_options)(cls).options(**options).remote()
        _handles[name] = handle
        return handle


def forget(role: str, node_id: str | None = None) -> None:
    """Drop this process's cached handle (after the actor died), so that the next call finds or creates a new one."""
    with _lock:
        _handles.pop(actor_name(role, node_id), None)


def actor_died(exc: BaseException) -> bool:
    """Whether ``exc`` says the actor is gone (as opposed to an error inside one of its methods)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, ActorDiedError | ActorUnavailableError | RayActorError)


def exit_when_idle(idle: Callable[[], bool], *, check_every_s: float) -> asyncio.Task[None]:
    """Inside an async actor: a task that kills the actor the first time ``idle()`` is true at a check."""
    import ray

    async def watch() -> None:
        while True:
            await asyncio.sleep(check_every_s)
            if idle():
                logger.info("%s: idle, exiting", ray.get_runtime_context().get_actor_name())
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    return asyncio.get_running_loop().create_task(watch())
