"""Every sample the loop returns carries the fields a generated sample carries, placeholders included.

Why: verl decides per *chunk* which optional tensors exist, from one sample. The legacy trainer's
``AgentLoopWorker._postprocess`` looks at ``inputs[0].response_logprobs`` / ``inputs[0].routed_experts`` and then
concatenates that field over every sample of the chunk; the V1 trainer stores each sample's fields on its own and
later reads ``rollout_log_probs`` for the whole batch (``_compute_old_log_prob`` -> ``calculate_debug_metrics``).
A sample without a field its neighbours have therefore kills the step (``KeyError: rollout_log_probs``, or a
``torch.cat`` over ``None``). The samples that lack them are exactly the infrastructure failures: a rollout whose
every attempt failed before the model was called (the placeholder), or one whose first generation was cut before it
returned. Both are masked, so what the fields hold does not matter, only that they are there with the right shape.

The rules (:func:`complete_optional_fields`, applied to every sample by the loop):
    * at least one response token: an empty response gets one masked padding token (verl puts the reward on the
      last response token);
    * ``response_logprobs``: present, one per response token, exactly when ``rollout.calculate_log_probs`` is on
      (the rollout server returns them only when asked, so a generated sample follows the same rule); a missing or
      short list is padded with 0.0 (masked tokens), a longer one cut;
    * ``routed_experts`` (router replay, ``rollout.enable_rollout_routing_replay``): present on every sample; a
      sample without them gets zeros of the shape the engine returns (tokens x MoE layers x top-k), taken from the
      last generated sample of this process, else from the model's config (``num_hidden_layers`` x
      ``num_experts_per_tok``).
Teacher log-probs (distillation) are computed by verl's own post-processing for every sample, so they need nothing.
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
