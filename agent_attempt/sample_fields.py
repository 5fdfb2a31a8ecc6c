"""Every sample the loop returns carries the fields a generated sample carries, placeholders included.

Why: verl decides per chunk which optional tensors exist from one sample (legacy ``AgentLoopWorker._postprocess``
reads ``inputs[0]``; V1 later reads ``rollout_log_probs`` for the whole batch), so a sample without a field its
neighbours have kills the step (``KeyError: rollout_log_probs``, a ``torch.cat`` over ``None``). Such samples are
the infrastructure failures (a placeholder, or a first generation cut before it returned); they are masked, so only
the fields' presence and shape matter.

Contract (:func:`complete_optional_fields`, on every sample): at least one response token (one masked padding
token); ``response_logprobs`` exactly when ``rollout.calculate_log_probs`` is on, one per response token (padded with
0.0 or cut); ``routed_experts`` under router replay on every sample, zeros of the engine's shape (from this
process's last generated sample, else the model's config). Teacher log-probs need nothing: verl computes them for
every sample.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

__all__ = ["OptionalFields", "complete_optional_fields"]

logger = logging.getLogger(__name__)

# (MoE layers, top-k) of the routed experts seen last in this process: the shape a placeholder copies.
_routed_shape_seen: tuple[int, ...] | None = None


class OptionalFields:
    """Which optional fields this run's samples carry, read once from the trainer config."""

    def __init__(self, rollout_config: Any, model_path: str | None = None) -> None:
        self.log_probs = bool(_get(rollout_config, "calculate_log_probs", False))
        self.routed_experts = bool(_get(rollout_config, "enable_rollout_routing_replay", False))
        self._model_path = model_path
        self._config_shape: tuple[int, ...] | None = None

    def routed_shape(self) -> tuple[int, ...]:
        """(MoE layers, top-k) for a sample with no routed experts of its own."""
        if _routed_shape_seen is not None:
            return _routed_shape_seen
        if self._config_shape is None:
            from transformers import AutoConfig

            if not self._model_path:
                raise ValueError("router replay is on but actor_rollout_ref.model.path is not set")
            config = AutoConfig.from_pretrained(self._model_path, trust_remote_code=True)
            config = getattr(config, "text_config", None) or config
            layers, top_k = getattr(config, "num_hidden_layers", None), getattr(config, "num_experts_per_tok", None)
            if not layers or not top_k:
                raise ValueError(
                    f"router replay is on but the model config at {self._model_path} names no num_hidden_layers / "
                    "num_experts_per_tok: cannot shape routed_experts for a sample the model never generated"
                )
            self._config_shape = (int(layers), int(top_k))
            logger.info("routed_experts of samples never generated: zeros of shape (tokens, %d, %d)", layers, top_k)
        return self._config_shape


def complete_optional_fields(output: AgentLoopOutput, fields: OptionalFields, tokenizer: Any) -> None:
    """Give ``output`` at least one response token and exactly the optional fields ``fields`` says (in place)."""
    global _routed_shape_seen
    if len(output.response_mask) == 0:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # verl's finalisation takes prompt_ids[-0:] (the whole prompt) as the response when the mask is empty.
        output.response_ids = [int(pad)]
        output.response_mask = [0]
    length = len(output.response_ids)
    if fields.log_probs:
        logprobs = list(output.response_logprobs or [])[:length]
        output.response_logprobs = logprobs + [0.0] * (length - len(logprobs))
    else:
        output.response_logprobs = None
    if fields.routed_experts:
        if output.routed_experts is not None:
            _routed_shape_seen = tuple(int(n) for n in np.shape(output.routed_experts)[1:])
        else:
            rows = len(output.prompt_ids) + length
            output.routed_experts = np.zeros((rows, *fields.routed_shape()), dtype=np.int16)


def _get(config: Any, key: str, default: Any) -> Any:
    getter = getattr(config, "get", None)
    return getter(key, default) if callable(getter) else getattr(config, key, default)
