"""The two patches that run in vLLM's worker process, where verl's worker extension loads the actor's weights.

:func:`keep_linear_weights` (on ``vllm.model_executor.layers.utils``): vLLM 0.24.0's CPU linear layers hand
``layer.weight`` to oneDNN and replace it with an empty tensor, so verl's first sync fails ("'Parameter' object has
no attribute 'weight_loader'"; with verl's own sender the trainer then hangs), and a layer that keeps its weight but
is not packed again serves the old weights after a reload that "succeeds". The wrapper always keeps
``layer.weight``, and verl's ``update_weights_from_ipc`` packs the new weights again after the last bucket (a second
copy of the linear weights is the cost).

:func:`copy_received_tensors` (on ``verl.workers.rollout.vllm_rollout.bucketed_weight_transfer``): a
``CopyingWeightReceiver`` copies each tensor out of the shared-memory buffer before vLLM sees it, so nothing vLLM
keeps points into a buffer verl reuses and then unlinks, and a failed load's traceback cannot make the segment's
``close()`` raise ``BufferError`` over the real error. Why both:
``docs/vllm-on-cpu.md#the-shims-and-the-traps-they-close``.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["copy_received_tensors", "keep_linear_weights"]


def keep_linear_weights(utils: ModuleType) -> None:
    """Make ``utils.dispatch_cpu_unquantized_gemm`` keep every layer's weight (idempotent)."""
    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_keeps_weight", False):
        return

    @functools.wraps(original)
    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        # The packed copy is rebuilt from layer.weight by process_weights_after_loading after every sync.
        original(layer, remove_weight=False)

    dispatch_keeping_weight._keeps_weight = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    logger.info("vllm_cpu: CPU linear layers keep their weights, so verl's weight sync can reload them")


def copy_received_tensors(transfer: ModuleType) -> None:
    """Make ``transfer.BucketedWeightReceiver`` the copying receiver (idempotent)."""
    if getattr(transfer.BucketedWeightReceiver, "_copies_tensors", False):
        return
    transfer.BucketedWeightReceiver = _copying_receiver_class(transfer.BucketedWeightReceiver)


def _copying_receiver_class(base: type) -> type:
    class CopyingWeightReceiver(base):  # type: ignore[misc, valid-type]
        """verl's receiver, handing vLLM copies of each bucket's tensors instead of views of the shared buffer."""

        _copies_tensors = True

        def receive_weights(self, on_bucket_received: Any) -> None:
            try:
                self._init_socket()
                self._init_buffer()
                while True:
                    metadata = self.socket.recv_pyobj()
                    weights = self._copy_bucket(metadata["bucket_meta"])
                    is_last = metadata["is_last"]
                    on_bucket_received(weights, is_last)
                    del weights
                    if not is_last:
                        self.socket.send(b"")
                    else:
                        self._ack_pending = True
                        break
            finally:
                self._cleanup()

        def _copy_bucket(self, bucket_meta: dict[str, Any]) -> list[tuple[str, Any]]:
            copies = []
            for name, meta in bucket_meta.items():
                if meta["handle"] is not None:
                    raise RuntimeError(
                        f"weight {name} came as a CUDA IPC handle; on CPU every tensor travels in the shared-memory "
                        "bucket (raise rollout.checkpoint_engine.update_weights_bucket_megabytes if it is too large)"
                    )
                dtype, shape, offset = meta["dtype"], meta["shape"], meta["offset"]
                size = dtype.itemsize * shape.numel()
                # One expression: no name keeps a view of the buffer alive past the copy, even if the copy fails.
                copies.append((name, self.buffer[offset : offset + size].view(dtype=dtype).view(shape).clone()))
            return copies

    CopyingWeightReceiver.__qualname__ = CopyingWeightReceiver.__name__
    return CopyingWeightReceiver
