"""The ``hfcpu`` rollout server: a Hugging Face transformers model behind verl's token-in/token-out ``generate``.

A stand-in for vLLM for tests, CI and the local rehearsal; never a default and never on a GPU node.

Contract: :class:`HFCpuServer` (run as a Ray actor by ``rollout.py``, or in-process by tests) answers what verl
0.9.1 calls on a rollout server, with vLLM's semantics: ``generate`` (sampling of ``sampling.py``, vLLM's default
``max_tokens``, stops at EOS and ``stop_token_ids``, log-probs, ``global_steps``, ``stop_reason``), weight updates,
``abort_request``/``abort_all_requests``/``resume_generation``, ``sleep`` and the profiler calls. Requests in flight
are decoded together (continuous batching up to ``max_batch_size``); each samples from its own generator seeded by
:func:`request_seed`, so the same seed replays the same episodes whatever order requests arrive in.

Guarantees: no response spans two weight versions; cancellation (``ray.cancel``, an abort) is checked before every
forward pass and the others go on; a forward pass that raises fails only the requests in it; decoding runs in one
thread of ``num_threads``. In full: ``docs/rehearsal-and-cpu-training.md#the-cpu-backend-in-detail``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from transformers import AutoModelForCausalLM
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import TokenOutput

from . import ROLLOUT_NAME, THREADS_KEY
from .decode_batch import ATTENTION, BatchRow, DecodeBatch
from .sampling import LOGPROBS_MODES, SamplingSpec, choose_token, parse_sampling_params

logger = logging.getLogger(__name__)

__all__ = ["ABORT_DRAIN_TIMEOUT_S", "HFCpuServer", "HFCpuSettings", "request_seed", "server_settings"]

# How long abort_all_requests waits for the requests it stopped to leave the batch: one forward pass each, but a
# long prompt's prefill is one forward pass too.
ABORT_DRAIN_TIMEOUT_S = 120.0
_TORCH_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class HFCpuSettings:
    """What the server reads from ``rollout.engine_kwargs.hfcpu``."""

    num_threads: int = dataclasses.field(default=1, metadata={"doc": "torch threads of the decode thread"})
    max_batch_size: int = dataclasses.field(
        default=64, metadata={"doc": "requests decoded together (1: one request at a time)"}
    )


def server_settings(config: RolloutConfig) -> HFCpuSettings:
    """The ``hfcpu`` settings of a rollout config (unknown keys raise, so a typo is not silently ignored)."""
    raw = dict((config.engine_kwargs or {}).get(ROLLOUT_NAME) or {})
    known = [field.name for field in dataclasses.fields(HFCpuSettings)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"unknown rollout.engine_kwargs.{ROLLOUT_NAME} key(s) {unknown}; known: {known}")
    settings = HFCpuSettings(**raw)
    for name in known:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            key = THREADS_KEY if name == "num_threads" else name
            raise ValueError(f"rollout.engine_kwargs.{ROLLOUT_NAME}.{key} must be an integer >= 1, got {value!r}")
    return settings


def request_seed(server_seed: int, weight_version: object, prompt: Sequence[int], key: str) -> int:
    """The seed of a request's sampling stream (see the module docstring): a 63-bit hash that Python's per-process
    hash randomisation does not touch."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{server_seed}|{weight_version}|{key}|".encode())
    digest.update(b"".join(int(token).to_bytes(8, "little", signed=True) for token in prompt))
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclasses.dataclass(frozen=True)
class _Outcome:
    tokens: list[int]
    log_probs: list[float]
    reason: str  # "stop", "length" or "abort"
    global_steps: int | None  # the weight version that produced the tokens


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    spec: SamplingSpec
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    # Settled from the decode thread (through the event loop) or, for a request never admitted, the event loop.
    outcome: asyncio.Future
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def finish(self, outcome: _Outcome | BaseException) -> None:
        """Settle the request's outcome (from any thread; the first outcome wins)."""
        self.loop.call_soon_threadsafe(_settle, self.outcome, outcome)


def _settle(future: asyncio.Future, outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _eos_ids(model_config: HFModelConfig) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model_config.tokenizer, model_config.hf_config, model_config.generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class HFCpuServer:
    """A Hugging Face causal LM serving verl's rollout-server calls (see the module docstring)."""

    def __init__(self, config: RolloutConfig | Mapping[str, Any], model_config: Any, replica_rank: int = 0) -> None:
        self.config: RolloutConfig = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        self.settings = server_settings(self.config)
        if self.config.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"rollout.logprobs_mode={self.config.logprobs_mode!r}: the hfcpu rollout returns log-probs, one of "
                f"{list(LOGPROBS_MODES)}"
            )
        if self.config.dtype not in _TORCH_DTYPES:
            raise ValueError(f"rollout.dtype={self.config.dtype!r} is not one of {sorted(_TORCH_DTYPES)}")
        torch.set_num_threads(self.settings.num_threads)
        self._model = self._load_model()
        layer_types = getattr(self._model.config.get_text_config(decoder=True), "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types):
            # The batch's left-padded cache assumes every layer keeps every position.
            raise NotImplementedError(f"the hfcpu rollout serves full-attention decoders, not {layer_types}")
        self._eos_ids = _eos_ids(self.model_config)
        max_positions = int(getattr(self.model_config.hf_config, "max_position_embeddings", 0) or 0)
        self.max_model_len = self.config.max_model_len or max_positions
        if not self.max_model_len or (max_positions and self.max_model_len > max_positions):
            raise ValueError(
                f"rollout.max_model_len={self.config.max_model_len} must be set and at most the model's "
                f"max_position_embeddings={max_positions}"
            )
        # Like vLLM's engine seed: reproducible runs, different streams per replica.
        self.seed = self.config.seed + replica_rank
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="hfcpu-decode",
            initializer=torch.set_num_threads,
            initargs=(self.settings.num_threads,),
        )
        # Shared with the decode thread: the queue of admitted requests and whether the thread serves them.
        self._state = threading.Lock()
        self._queue: collections.deque[_Request] = collections.deque()
        self._serving = False
        self._paused = False
        self._update_lock = asyncio.Lock()
        self._requests: set[_Request] = set()
        self._admission = asyncio.Event()
        self._admission.set()
        self._rejecting = False
        self._prompt_counts: collections.Counter[bytes] = collections.Counter()
        self._counted_version: object = None
        self._logged: set[str] = set()
        self.global_steps: int | None = None
        self.weight_updates = 0
        logger.info(
            "hfcpu server %d: %s, dtype %s, %d thread(s), batches of up to %d, eos %s, max_model_len %d",
            replica_rank,
            self.model_config.local_path,
            self.config.dtype,
            self.settings.num_threads,
            self.settings.max_batch_size,
            sorted(self._eos_ids),
            self.max_model_len,
        )

    def _load_model(self) -> torch.nn.Module:
        dtype = _TORCH_DTYPES[self.config.dtype]
        # sdpa whatever the model config says: flash-attention kernels do not exist on CPU.
        if self.config.load_format == "dummy":
            # vLLM's "dummy": random weights, replaced by the actor's before the first rollout.
            model = AutoModelForCausalLM.from_config(
                self.model_config.hf_config, dtype=dtype, attn_implementation="sdpa"
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_config.local_path,
                config=self.model_config.hf_config,
                dtype=dtype,
                attn_implementation="sdpa",
                trust_remote_code=self.model_config.trust_remote_code,
            )
        model.set_attn_implementation(ATTENTION)
        return model.eval()

    def describe(self) -> dict[str, Any]:
        """What this server runs (for logs and checks)."""
        return {
            "model_path": self.model_config.local_path,
            "dtype": self.config.dtype,
            "num_threads": self.settings.num_threads,
            "max_batch_size": self.settings.max_batch_size,
            "eos_token_ids": sorted(self._eos_ids),
            "max_model_len": self.max_model_len,
            "global_steps": self.global_steps,
            "weight_updates": self.weight_updates,
        }

    # ----- generation

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        priority: int = 0,
    ) -> TokenOutput:
        """Token-in/token-out generation, the call ``LLMServerClient.generate`` makes (see the module docstring)."""
        if image_data or video_data or audio_data:
            raise NotImplementedError("the hfcpu rollout serves text-only models")
        if priority:
            self._log_once("priority", "hfcpu serves requests in arrival order; request priority is ignored")
        prompt = [int(token) for token in prompt_ids]
        if not prompt:
            raise ValueError("generate needs at least one prompt token")
        spec = parse_sampling_params(
            sampling_params,
            default_max_tokens=min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - len(prompt)
            ),
            max_possible_tokens=self.max_model_len - len(prompt),
            repetition_penalty=self.config.repetition_penalty,
            ignore_eos=self.config.ignore_eos,
        )
        while not self._admission.is_set():
            if self._rejecting:
                return self._output([], None, "aborted", self.global_steps)
            await self._admission.wait()
        loop = asyncio.get_running_loop()
        seed = spec.seed if spec.seed is not None else self._request_seed(prompt, request_id)
        request = _Request(
            request_id, prompt, spec, torch.Generator().manual_seed(seed), loop, outcome=loop.create_future()
        )
        self._requests.add(request)
        try:
            with self._state:
                self._queue.append(request)
            self._start_serving()
            outcome = await self._outcome(request)
        finally:
            self._requests.discard(request)
            request.done.set()
        stop_reason = "aborted" if outcome.reason == "abort" else "completed"
        log_probs = outcome.log_probs if spec.logprobs else None
        return self._output(outcome.tokens, log_probs, stop_reason, outcome.global_steps)

    def _request_seed(self, prompt: list[int], request_id: str) -> int:
        version = (self.weight_updates, self.global_steps)
        if version != self._counted_version:
            self._prompt_counts.clear()  # counts restart with every weight version (the version is in the hash)
            self._counted_version = version
        # verl's run-stable request id under full_determinism, else nothing (a fresh uuid4 per turn is no key)
        name = f"id:{request_id}" if self.config.full_determinism else "n"
        key = hashlib.blake2b(f"{name}|{prompt!r}".encode(), digest_size=16).digest()
        occurrence = self._prompt_counts[key]
        self._prompt_counts[key] += 1
        return request_seed(self.seed, version, prompt, f"{name}:{occurrence}")

    @staticmethod
    def _output(
        tokens: list[int], log_probs: list[float] | None, stop_reason: str, global_steps: int | None
    ) -> TokenOutput:
        # No prefix cache: no prompt token is ever served from one.
        extra_fields = {"global_steps": global_steps, "num_cached_tokens": 0}
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason=stop_reason, extra_fields=extra_fields)

    async def _outcome(self, request: _Request) -> _Outcome:
        try:
            return await asyncio.shield(request.outcome)
        except asyncio.CancelledError:
            self._cancel(request)
            # Re-raised only once the sequence has left the batch.
            while not request.outcome.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([request.outcome])
            raise

    def _cancel(self, request: _Request) -> None:
        """Stop a request: answered here if it still waits for admission, else by the decode thread."""
        request.cancel.set()
        with self._state:
            queued = request in self._queue
            if queued:
                self._queue.remove(request)
        if queued:
            request.finish(_Outcome([], [], "abort", self.global_steps))

    def _start_serving(self) -> None:
        with self._state:
            if self._serving or self._paused or not self._queue:
                return
            self._serving = True
        self._executor.submit(self._serve)

    # ----- the decode thread

    def _serve(self) -> None:
        """Decode until no request is admitted or in the batch (runs in the decode thread)."""
        batch = DecodeBatch()
        try:
            while True:
                with self._state:
                    room = 0 if self._paused else self.settings.max_batch_size - len(batch)
                    admitted = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
                    if not admitted and not len(batch):
                        self._serving = False
                        return
                with torch.inference_mode():
                    for request in admitted:
                        self._drop_cancelled(batch)
                        self._prefill(request, batch)
                    self._drop_cancelled(batch)
                    self._choose_tokens(batch)
                    try:
                        batch.step(self._model)
                    except Exception as exc:
                        logger.exception("hfcpu server %d: a decode step failed", self.replica_rank)
                        for row in batch.clear():
                            row.request.finish(exc)
        except BaseException as exc:
            logger.exception("hfcpu server %d: the decode thread stopped", self.replica_rank)
            # Nothing may be left waiting for a thread that is gone.
            with self._state:
                self._serving = False
                stranded = [row.request for row in batch.clear()] + list(self._queue)
                self._queue.clear()
            for request in stranded:
                request.finish(exc)
            raise

    def _prefill(self, request: _Request, batch: DecodeBatch) -> None:
        if request.cancel.is_set():
            request.finish(_Outcome([], [], "abort", self.global_steps))
            return
        try:
            output = self._model(input_ids=torch.tensor([request.prompt]), use_cache=True, logits_to_keep=1)
        except Exception as exc:
            logger.exception("hfcpu server %d: the prefill of request %s failed", self.replica_rank, request.request_id)
            request.finish(exc)
            return
        seen = None
        if request.spec.repetition_penalty != 1.0:
            seen = torch.zeros(output.logits.shape[-1], dtype=torch.bool)
            seen[request.prompt] = True
        row = BatchRow(request, length=len(request.prompt), logits=output.logits[0, -1], seen=seen)
        batch.join(row, output.past_key_values)

    def _drop_cancelled(self, batch: DecodeBatch) -> None:
        for row in batch.sequences():
            if row.request.cancel.is_set():
                self._leave(row, "abort")

    def _choose_tokens(self, batch: DecodeBatch) -> None:
        """One token for every sequence in the batch, from its own generator; finished sequences leave."""
        for row in batch.sequences():
            spec = row.request.spec
            try:
                token, log_prob = choose_token(
                    row.logits,
                    spec,
                    seen=row.seen,
                    generator=row.request.generator,
                    logprobs_mode=self.config.logprobs_mode,
                )
            except Exception as exc:
                row.left = True
                row.request.finish(exc)
                continue
            row.tokens.append(token)
            row.log_probs.append(log_prob)
            if row.seen is not None:
                row.seen[token] = True
            if token in spec.stop_token_ids or (token in self._eos_ids and not spec.ignore_eos):
                self._leave(row, "stop")
            elif len(row.tokens) >= spec.max_tokens:
                self._leave(row, "length")

    def _leave(self, row: BatchRow, reason: str) -> None:
        row.left = True
        row.request.finish(_Outcome(row.tokens, row.log_probs, reason, self.global_steps))

    async def _in_decode_thread(self, function: Callable[..., _T], *args: Any) -> _T:
        """Run ``function`` in the decode thread, after what it already has to do; a cancel waits for it to end."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, function, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            raise

    # ----- aborts

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Stop the request(s) with this id (in the batch or waiting for it); they return ``"aborted"``."""
        matching = [request for request in self._requests if request.request_id == request_id]
        for request in matching:
            self._cancel(request)
        if not matching:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        return {"aborted": True, "request_id": request_id}

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Stop every request and hold (or, with ``reject_request``, refuse) new ones until ``resume_generation``."""
        self._admission.clear()
        self._rejecting = reject_request
        stopped = list(self._requests)
        for request in stopped:
            self._cancel(request)
        if stopped:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(request.done.wait() for request in stopped)), ABORT_DRAIN_TIMEOUT_S
                )
            except TimeoutError as exc:
                raise TimeoutError(
                    f"aborted requests did not leave the batch within {ABORT_DRAIN_TIMEOUT_S:.0f} s"
                ) from exc
        request_ids = [request.request_id for request in stopped]
        logger.info("hfcpu server %d: aborted %d request(s)", self.replica_rank, len(request_ids))
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_generation(self) -> None:
        """Admit requests again after :meth:`abort_all_requests`."""
        self._rejecting = False
        self._admission.set()

    # ----- weights

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], global_steps: int | None = None) -> dict:
        """Load the actor's full weights (by Hugging Face parameter name) once the batch in flight has drained."""
        async with self._update_lock:
            with self._state:
                self._paused = True
            try:
                # The decode thread runs this once its batch is empty: a paused server admits nothing new.
                loaded = await self._in_decode_thread(self._load_weights, state_dict)
                self.weight_updates += 1
                if global_steps is not None:
                    self.global_steps = global_steps
            finally:
                with self._state:
                    self._paused = False
                self._start_serving()
        return {"tensors": loaded, "global_steps": self.global_steps, "weight_updates": self.weight_updates}

    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        own = self._model.state_dict()
        unexpected = sorted(set(state_dict) - set(own))
        if unexpected:
            raise KeyError(f"the rollout model has no parameter(s) {unexpected[:5]} (of {len(unexpected)})")
        loaded_storage = {own[name].data_ptr() for name in state_dict}
        # A name may be missing only when its tensor is tied to one that was sent (lm_head and the embeddings).
        untied_missing = sorted(
            name for name in set(own) - set(state_dict) if own[name].data_ptr() not in loaded_storage
        )
        if untied_missing:
            raise KeyError(f"the update lacks parameter(s) {untied_missing[:5]} (of {len(untied_missing)})")
        with torch.no_grad():
            self._model.load_state_dict(dict(state_dict), strict=False)
        return len(state_dict)

    async def set_global_steps(self, global_steps: int) -> None:
        """Record the weight version reported in every ``TokenOutput.extra_fields``."""
        self.global_steps = global_steps

    # ----- lifecycle calls verl makes on every rollout server

    async def sleep(self) -> None:
        """Nothing to free: vLLM hands its device memory back to training here; the model lives in host memory the
        trainer shares, and its weights stay valid until the next update overwrites them."""

    async def start_profile(self, **kwargs: Any) -> None:
        self._log_once("profile", "the hfcpu rollout has no profiler; rollout profiling is skipped")

    async def stop_profile(self) -> None:
        self._log_once("profile", "the hfcpu rollout has no profiler; rollout profiling is skipped")

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("hfcpu server %d: %s", self.replica_rank, message)
