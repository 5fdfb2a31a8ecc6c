"""The ``hfcpu`` rollout server: a Hugging Face transformers model behind verl's token-in/token-out ``generate``.

A stand-in for vLLM on machines without a GPU, for tests, CI and the local rehearsal; never a default and never on
a GPU node. It serves one request at a time (no batching, no prefix cache), which is what a 2-core machine can do.

What it owns
    :class:`HFCpuServer`, a plain class that ``rollout.py`` runs as a Ray actor (and tests may run in-process). It
    answers what verl 0.9.1 calls on a rollout server:
      * ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput``, as ``LLMServerClient`` calls it:
        the sampling parameters of ``sampling.py`` (temperature 0 is greedy), ``max_tokens`` defaulting to vLLM's
        ``min(response_length, prompt_length + response_length - len(prompt))`` within ``max_model_len``, a stop at
        any end-of-sequence id (tokenizer, model config and generation config; none with ``ignore_eos``) and at any
        of the request's ``stop_token_ids`` (the stop token is the last one returned, as vLLM returns it),
        ``log_probs`` when ``logprobs`` is asked, and ``extra_fields["global_steps"]``, the weight version the
        trainer set. ``stop_reason`` follows vLLM's server in verl: ``"completed"`` for an EOS and for the token
        budget alike, ``"aborted"`` for a request stopped by an abort.
      * ``update_weights(state_dict, global_steps)`` and ``set_global_steps(global_steps)`` for the weights the actor
        sends every training step (``rollout.HFCpuServerAdapter``).
      * ``abort_request(request_id)``, ``abort_all_requests(reject_request=False)`` and ``resume_generation()``
        with vLLM's semantics: an aborted request returns at once with the tokens it has and
        ``stop_reason="aborted"``; after ``abort_all_requests`` new requests wait until ``resume_generation()``, or
        are answered ``"aborted"`` at once with ``reject_request=True``.
      * ``sleep()``: nothing to do on CPU (see its docstring); ``start_profile``/``stop_profile``: no rollout
        profiler here, logged once.

Guarantees
    * One model lock. A generation holds it from its first forward pass to its last; a weight update holds it while
      it loads, so a response is never produced by two weight versions.
    * Cancellation is checked between tokens: a request cancelled in any way (its coroutine cancelled, as Ray's
      ``ray.cancel`` and an in-process caller's cancel do; ``abort_request``; ``abort_all_requests``) stops within
      one forward pass and releases the lock; a cancelled coroutine re-raises ``CancelledError`` after the decode
      thread has let go of the model. Cancelling the *caller* of a Ray call is not enough: Ray 2.60 does not cancel
      the actor task when the awaiting asyncio task is cancelled (the same holds for vLLM's server), which is why
      the recipe's loop ``ray.cancel``s the requests of a generation it cuts (``browser_agent_loop.generate_within``).
    * The decode runs in one dedicated thread with ``torch.set_num_threads(num_threads)``
      (``rollout.engine_kwargs.hfcpu.num_threads``, default 1), so the server does not starve a browser or the
      trainer on a small machine; the actor's event loop stays free for aborts and weight updates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import TokenOutput

from . import ROLLOUT_NAME, THREADS_KEY
from .sampling import LOGPROBS_MODES, SamplingSpec, choose_token, parse_sampling_params

logger = logging.getLogger(__name__)

__all__ = ["ABORT_DRAIN_TIMEOUT_S", "HFCpuServer", "server_settings"]

# How long abort_all_requests waits for the requests it stopped to let go of the model: one forward pass each, but a
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


@dataclasses.dataclass(frozen=True)
class HFCpuSettings:
    """What the server reads from ``rollout.engine_kwargs.hfcpu``."""

    num_threads: int = 1


def server_settings(config: RolloutConfig) -> HFCpuSettings:
    """The ``hfcpu`` settings of a rollout config (unknown keys raise, so a typo is not silently ignored)."""
    raw = dict((config.engine_kwargs or {}).get(ROLLOUT_NAME) or {})
    unknown = sorted(set(raw) - {field.name for field in dataclasses.fields(HFCpuSettings)})
    if unknown:
        raise ValueError(f"unknown rollout.engine_kwargs.{ROLLOUT_NAME} key(s) {unknown}; known: [{THREADS_KEY!r}]")
    settings = HFCpuSettings(**raw)
    if settings.num_threads < 1:
        raise ValueError(f"rollout.engine_kwargs.{ROLLOUT_NAME}.{THREADS_KEY} must be >= 1, got {settings.num_threads}")
    return settings


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


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
        self._eos_ids = _eos_ids(self.model_config)
        max_positions = int(getattr(self.model_config.hf_config, "max_position_embeddings", 0) or 0)
        self.max_model_len = self.config.max_model_len or max_positions
        if not self.max_model_len or (max_positions and self.max_model_len > max_positions):
            raise ValueError(
                f"rollout.max_model_len={self.config.max_model_len} must be set and at most the model's "
                f"max_position_embeddings={max_positions}"
            )
        # Like vLLM's engine seed: reproducible runs, different streams per replica.
        self._generator = torch.Generator().manual_seed(self.config.seed + replica_rank)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="hfcpu-decode",
            initializer=torch.set_num_threads,
            initargs=(self.settings.num_threads,),
        )
        self._model_lock = asyncio.Lock()
        self._requests: set[_Request] = set()
        self._admission = asyncio.Event()
        self._admission.set()
        self._rejecting = False
        self._logged: set[str] = set()
        self.global_steps: int | None = None
        self.weight_updates = 0
        logger.info(
            "hfcpu server %d: %s, dtype %s, %d thread(s), eos %s, max_model_len %d",
            replica_rank,
            self.model_config.local_path,
            self.config.dtype,
            self.settings.num_threads,
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
        return model.eval()

    def describe(self) -> dict[str, Any]:
        """What this server runs (for logs and checks)."""
        return {
            "model_path": self.model_config.local_path,
            "dtype": self.config.dtype,
            "num_threads": self.settings.num_threads,
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
                return self._output([], None, "aborted")
            await self._admission.wait()
        request = _Request(request_id)
        self._requests.add(request)
        try:
            async with self._model_lock:
                tokens, log_probs, finish = await self._decode_in_thread(request, prompt, spec)
        finally:
            self._requests.discard(request)
            request.done.set()
        stop_reason = "aborted" if finish == "abort" else "completed"
        return self._output(tokens, log_probs if spec.logprobs else None, stop_reason)

    def _output(self, tokens: list[int], log_probs: list[float] | None, stop_reason: str) -> TokenOutput:
        # No prefix cache: no prompt token is ever served from one.
        extra_fields = {"global_steps": self.global_steps, "num_cached_tokens": 0}
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason=stop_reason, extra_fields=extra_fields)

    async def _decode_in_thread(
        self, request: _Request, prompt: list[int], spec: SamplingSpec
    ) -> tuple[list[int], list[float], str]:
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._decode, request, prompt, spec)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            request.cancel.set()
            # The thread stops before its next token; the lock must not be released while it still runs.
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(future)
            raise

    def _decode(self, request: _Request, prompt: list[int], spec: SamplingSpec) -> tuple[list[int], list[float], str]:
        """The decode loop (runs in the decode thread): prefill, then one cached forward pass per token."""
        generator = self._generator if spec.seed is None else torch.Generator().manual_seed(spec.seed)
        tokens: list[int] = []
        log_probs: list[float] = []
        if request.cancel.is_set():
            return tokens, log_probs, "abort"
        with torch.inference_mode():
            output = self._model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            seen = None
            if spec.repetition_penalty != 1.0:
                seen = torch.zeros(output.logits.shape[-1], dtype=torch.bool)
                seen[prompt] = True
            for step in range(spec.max_tokens):
                if request.cancel.is_set():
                    return tokens, log_probs, "abort"
                token, log_prob = choose_token(
                    output.logits[0, -1],
                    spec,
                    seen=seen,
                    generator=generator,
                    logprobs_mode=self.config.logprobs_mode,
                )
                tokens.append(token)
                log_probs.append(log_prob)
                if seen is not None:
                    seen[token] = True
                if token in spec.stop_token_ids or (token in self._eos_ids and not spec.ignore_eos):
                    return tokens, log_probs, "stop"
                if step + 1 < spec.max_tokens:
                    output = self._model(
                        input_ids=torch.tensor([[token]]), past_key_values=output.past_key_values, use_cache=True
                    )
        return tokens, log_probs, "length"

    # ----- aborts

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Stop the request(s) with this id (running or waiting for the model); they return ``"aborted"``."""
        matching = [request for request in self._requests if request.request_id == request_id]
        for request in matching:
            request.cancel.set()
        if not matching:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        return {"aborted": True, "request_id": request_id}

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Stop every request and hold (or, with ``reject_request``, refuse) new ones until ``resume_generation``."""
        self._admission.clear()
        self._rejecting = reject_request
        stopped = list(self._requests)
        for request in stopped:
            request.cancel.set()
        if stopped:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(request.done.wait() for request in stopped)), ABORT_DRAIN_TIMEOUT_S
                )
            except TimeoutError as exc:
                raise TimeoutError(
                    f"aborted requests did not release the model within {ABORT_DRAIN_TIMEOUT_S:.0f} s"
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
        """Load the actor's full weights (by Hugging Face parameter name) between two generations."""
        async with self._model_lock:
            loaded = await asyncio.get_running_loop().run_in_executor(self._executor, self._load_weights, state_dict)
            self.weight_updates += 1
            if global_steps is not None:
                self.global_steps = global_steps
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
