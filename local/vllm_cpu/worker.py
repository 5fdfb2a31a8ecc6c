"""The two patches that run in vLLM's worker process, where verl's worker extension loads the actor's weights.

:func:`keep_linear_weights` (on ``vllm.model_executor.layers.utils``)
    vLLM 0.24.0's CPU linear layers (``UnquantizedLinearMethod.process_weights_after_loading``) hand
    ``layer.weight`` to oneDNN, which packs a copy, and replace the weight with an empty tensor
    (``remove_weight=True``); embeddings and a tied lm_head keep theirs but compute logits from the packed copy
    too. verl's first sync then fails (measured: "'Parameter' object has no attribute 'weight_loader'", the empty
    stand-in has no loader; with verl's own sender the trainer then hangs). A layer that keeps its weight but is
    not packed again is worse: the reload "succeeds" and the forward pass still reads the old packed copy (a
    log-prob gap of 17.4 measured that way on the lm_head). The wrapper always keeps ``layer.weight``; verl's
    ``update_weights_from_ipc`` calls vLLM's ``process_weights_after_loading`` after the last bucket, which packs
    the new weights again (``check.py`` shows each sync taking effect). Costs a second copy of the linear weights.

:func:`copy_received_tensors` (on ``verl.workers.rollout.vllm_rollout.bucketed_weight_transfer``)
    Replaces ``BucketedWeightReceiver`` with a subclass, ``CopyingWeightReceiver``: each tensor of a bucket is
    copied out of the shared-memory buffer before vLLM sees it. verl's receiver hands vLLM views into the buffer,
    which it reuses for the next bucket and which the sender unlinks at the end; a loader that keeps the tensor
    (instead of copying into its parameter) would keep pointing there, and after a failed load the views held by the
    traceback make the segment's ``close()`` raise ``BufferError``, hiding the real error.
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
