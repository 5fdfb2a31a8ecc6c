"""A copy of a Qwen2 policy whose attention heads are wider, zero-padded, computing the same function and training
the same way.

Contract: :func:`widen_heads` writes a folder whose heads are ``head_dim`` wide (32 by default; vLLM's CPU attention
refuses the tiny policies' 16) that verl's FSDP actor, transformers and vLLM all load, with logits equal to the
original's up to float rounding (:func:`max_logit_gap`; the test holds it under :data:`LOGIT_TOLERANCE`). The copy
is a Granite whose ``attention_multiplier`` is the original's ``d ** -0.5``, so no weight is rescaled and Adam sees
the original's parameters; each rotary pair keeps its frequency, and the padding stays zero under training. Only
the attention projections change (``o_proj`` gains a zero bias). Why a Granite and how each head keeps its function:
``docs/vllm-on-cpu.md#the-wide-head-copy``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

__all__ = [
    "LOGIT_TOLERANCE",
    "VLLM_CPU_HEAD_SIZES",
    "WIDENED_FROM_KEY",
    "max_logit_gap",
    "widen_heads",
    "widened_from",
    "widened_state_dict",
]

# The head sizes vLLM 0.24.0's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# Widened logits against the original's, float32 on CPU: measured 4e-6 on local/deal_policy (the order of float32
# rounding over two layers); the bound leaves room for other thread counts and kernels.
LOGIT_TOLERANCE = 1e-4
# The copy's config.json records the original's model_type under this key: verl picks the token builder that joins
# turns and tool responses by model_type, and the copy's chat template is still the original's (a Granite type gets
# verl's generic builder, which drops the newline after each <|im_end|>; the deal policy then did 0.35 instead of
# 0.40 before any training). Runs on the copy set nemo_gym_browser.token_builder_model_type to it (run_spec).
WIDENED_FROM_KEY = "widened_from_model_type"
_QWEN2_ONLY = ("layer_types", "max_window_layers", "sliding_window", "use_sliding_window")
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
           "special_tokens_map.json", "warm_start.json")  # fmt: skip


def _head_rows(old: int, new: int, rotary: bool) -> torch.Tensor:
    """Where each of a head's ``old`` dimensions goes in a head of ``new`` (index tensor of length ``old``)."""
    if not rotary:
        return torch.arange(old)
    stride = new // old
    half = torch.arange(old // 2) * stride
    return torch.cat([half, half + new // 2])


def _widen_rows(weight: torch.Tensor, heads: int, old: int, new: int, rotary: bool) -> torch.Tensor:
    """``weight`` ([heads*old, ...] or a bias [heads*old]) laid out for heads of width ``new``, the rest zero."""
    rest = weight.shape[1:]
    per_head = weight.reshape(heads, old, *rest)
    wide = torch.zeros(heads, new, *rest, dtype=weight.dtype)
    wide[:, _head_rows(old, new, rotary)] = per_head
    return wide.reshape(heads * new, *rest)


def widened_state_dict(
    state: dict[str, torch.Tensor], *, num_heads: int, num_kv_heads: int, old: int, new: int
) -> dict[str, torch.Tensor]:
    """The tensors of a Qwen2 state dict with every attention head widened from ``old`` to ``new`` dimensions."""
    if new % old or new < old or old % 2:
        raise ValueError(f"the new head width must be a multiple of the old one (even): {old} -> {new}")
    out = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            out[name] = _widen_rows(tensor, num_heads, old, new, rotary=True)
        elif ".self_attn.k_proj." in name:
            out[name] = _widen_rows(tensor, num_kv_heads, old, new, rotary=True)
        elif ".self_attn.v_proj." in name:
            out[name] = _widen_rows(tensor, num_kv_heads, old, new, rotary=False)
        elif ".self_attn.o_proj.weight" in name:
            out[name] = _widen_rows(tensor.t(), num_heads, old, new, rotary=False).t().contiguous()
            bias = name.replace(".weight", ".bias")
            if bias not in state:
                out[bias] = torch.zeros(tensor.shape[0], dtype=tensor.dtype)
        else:
            out[name] = tensor.clone()
    return out


def widen_heads(source: Path, output: Path, *, head_dim: int = 32) -> Path:
    """Write ``output``: ``source`` (a Qwen2 folder) as a Granite with attention heads ``head_dim`` wide, the same
    function and parameters.

    Returns ``output``. Raises ``ValueError`` for another architecture, a width that is not a multiple of the
    current one, or a width vLLM's CPU attention does not take.
    """
    from safetensors.torch import load_file, save_file

    source, output = Path(source), Path(output)
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise ValueError(f"{source}: only Qwen2 policies are widened, not {config.get('model_type')!r}")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    old = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(f"vLLM's CPU attention takes head sizes {VLLM_CPU_HEAD_SIZES}, not {head_dim}")
    state = load_file(source / "model.safetensors")
    wide = widened_state_dict(state, num_heads=heads, num_kv_heads=kv_heads, old=old, new=head_dim)
    output.mkdir(parents=True, exist_ok=True)
    save_file(wide, output / "model.safetensors", metadata={"format": "pt"})
    for key in _QWEN2_ONLY:
        config.pop(key, None)
    config.update(architectures=["GraniteForCausalLM"], model_type="granite", head_dim=head_dim, attention_bias=True,
                  mlp_bias=False, attention_multiplier=old**-0.5, embedding_multiplier=1.0, residual_multiplier=1.0,
                  logits_scaling=1.0)  # fmt: skip
    config[WIDENED_FROM_KEY] = "qwen2"
    (output / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in _COPIED:
        if (source / name).exists():
            shutil.copy2(source / name, output / name)
    return output


def widened_from(folder: Path) -> str | None:
    """The model_type of the policy ``folder`` was widened from (:data:`WIDENED_FROM_KEY`), ``None`` for a policy
    that is not a widened copy or a folder without a readable config."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get(WIDENED_FROM_KEY) if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


@torch.no_grad()
def max_logit_gap(first: Path, second: Path, token_ids: list[list[int]]) -> float:
    """The largest absolute difference between two model folders' logits (float32, CPU) on the same tokens."""
    from transformers import AutoModelForCausalLM

    gap = 0.0
    models = [
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
        for folder in (first, second)
    ]
    for ids in token_ids:
        batch = torch.tensor([ids])
        logits = [model(input_ids=batch).logits for model in models]
        gap = max(gap, float((logits[0] - logits[1]).abs().max()))
    return gap
