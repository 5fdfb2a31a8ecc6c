"""Checks shared by the tests of the shipped tiny policies (``local/deal_policy``, ``local/aisle_policy``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_gym_browser.local import policy_model
from nemo_gym_browser.local import tiny_policy as tp


def recorded_hashes(policy: Path) -> dict[str, str]:
    lines = (policy / "SHA256SUMS").read_text(encoding="utf-8").splitlines()
    return {name.strip(): digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}


def check_shipped_weights(policy: Path) -> dict[str, Any]:
    """Assert the files hash as recorded and the model loads with the code's tokenizer; the warm-start report."""
    for name, digest in recorded_hashes(policy).items():
        assert hashlib.sha256((policy / name).read_bytes()).hexdigest() == digest, name
    assert "model.safetensors" in recorded_hashes(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    assert model.config.vocab_size == len(policy_model.policy_tokenizer())
    assert AutoTokenizer.from_pretrained(policy).get_vocab() == policy_model.policy_tokenizer().get_vocab()
    return json.loads((policy / tp.REPORT_FILE).read_text())
