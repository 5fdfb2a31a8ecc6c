"""verl's ``vllm`` rollout adapter with a weight sync that raises instead of hanging.

verl 0.9.1's ``ServerAdapter.update_weights`` asks the vLLM server to receive (``update_weights_from_ipc``, a Ray
call it does not await yet), then sends the buckets with ``BucketedWeightSender``, which waits for each bucket's
acknowledgement with a blocking ``socket.recv()``. When the vLLM worker fails to load a bucket it raises and closes
its socket without acknowledging: the sender waits forever, the Ray call's error is never looked at, and the trainer
hangs with nothing in its log. :class:`CpuServerAdapter` sends with :class:`WatchedWeightSender`, which polls for
the acknowledgement and, between polls, looks at the server's receive call: if it ended with an error,
:class:`~nemo_gym_browser.local.vllm_cpu.WeightSyncError` carries that error; if it ended without one while the
sender still waits, or nothing at all happens for ``WEIGHT_SYNC_TIMEOUT_S``, the sync fails too. It refuses the
CUDA IPC path (which a process without ``VERL_PLATFORM=cpu`` would take).

Everything else is verl's own ``ServerAdapter``; this module imports vLLM (through verl), so only the rollout
registry names it, and it is imported where verl builds the rollout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
import zmq
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from . import WEIGHT_SYNC_TIMEOUT_S, WeightSyncError

logger = logging.getLogger(__name__)

__all__ = ["CpuServerAdapter", "WatchedWeightSender", "receiver_state"]

POLL_INTERVAL_MS = 200


def receiver_state(call: ray.ObjectRef | None) -> str | None:
    """``None`` while the server's receive call runs (or there is none to watch); else why the sync cannot go on."""
    if call is None:
        return None
    ready, _ = ray.wait([call], timeout=0)
    if not ready:
        return None
    try:
        ray.get(call)
    except Exception as exc:  # the server's own error, whatever its type
        return f"the vLLM server failed to load the weights: {type(exc).__name__}: {exc}"
    return "the vLLM server stopped receiving weights before the sender finished"


class _WatchedSocket:
    """A REQ socket whose ``recv`` polls, asking ``failure()`` between polls; everything else passes through."""

    def __init__(self, socket: Any, failure: Callable[[], str | None], timeout_s: float) -> None:
        self._socket = socket
        self._failure = failure
        self._timeout_s = timeout_s
        socket.setsockopt(zmq.LINGER, 0)  # a failed sync must not block close() on an unsent message

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self._timeout_s
        while not self._socket.poll(POLL_INTERVAL_MS, zmq.POLLIN):
            reason = self._failure()
            # The receiver acknowledges its last bucket just before its call returns: look once more.
            if reason is not None and not self._socket.poll(0, zmq.POLLIN):
                raise WeightSyncError(reason)
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"the vLLM server acknowledged no weight bucket for {self._timeout_s:.0f} s (its receive call is "
                    "still running): the sync is stuck"
                )
        return self._socket.recv(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


class WatchedWeightSender(BucketedWeightSender):
    """verl's sender whose waits for the receiver end with an error when the receiver failed or went silent."""

    def __init__(
        self, *args: Any, receiver_call: ray.ObjectRef | None, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._receiver_call = receiver_call
        self._timeout_s = timeout_s

    def _init_socket(self) -> None:
        super()._init_socket()
        self.socket = _WatchedSocket(self.socket, lambda: receiver_state(self._receiver_call), self._timeout_s)


class CpuServerAdapter(ServerAdapter):
    """verl's vLLM ``ServerAdapter`` for vLLM's CPU build: full-tensor syncs through shared memory that fail loudly."""

    weight_sync_timeout_s = WEIGHT_SYNC_TIMEOUT_S

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Any,
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"vLLM on CPU takes full named tensors, not wire_format={wire_format!r}")
        if not self.use_shm:
            raise WeightSyncError(
                "verl chose CUDA IPC for this weight sync: the process does not run verl's cpu platform "
                "(VERL_PLATFORM=cpu), which vLLM on CPU needs"
            )
        started = time.monotonic()
        call = await self._execute_method("update_weights_from_ipc", non_block=True, kwargs={**kwargs, "use_shm": True})
        sender = WatchedWeightSender(
            zmq_handle=self.zmq_handle,
            bucket_size_mb=self.config.checkpoint_engine.update_weights_bucket_megabytes,
            use_shm=True,
            receiver_call=call,
            timeout_s=self.weight_sync_timeout_s,
        )
        await sender.async_send_weights(weights)
        if call is not None:
            try:
                await call
            except Exception as exc:
                raise WeightSyncError(f"the vLLM server failed to load the weights: {exc}") from exc
        if self._has_server:
            await self.server_handle.clear_kv_cache.remote()
            if global_steps is not None:
                await self.server_handle.set_global_steps.remote(global_steps)
        logger.info(
            "vllm_cpu: weights of step %s synced to replica %d in %.2f s",
            global_steps,
            self.replica_rank,
            time.monotonic() - started,
        )
