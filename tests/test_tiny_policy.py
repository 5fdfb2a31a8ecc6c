"""The tiny policy: its tokenizer, its demonstrations (exactly what the recipe's loop produced), the warm start's
loss, a model folder that verl and the hfcpu rollout server load and whose greedy first turn is a browser call, and
a builder that gives the same weights for the same seed.

The builds here are small (one task of each kind, a few steps) so the tier stays fast; the measured policy is the
CLI's default (see the README's "A tiny policy").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from verl.workers.config import HFModelConfig

from nemo_gym_browser.agent_attempt.stepwise import STEP_HISTORY_HEADER
from nemo_gym_browser.local import policy_evaluation, policy_model, warm_start
from nemo_gym_browser.local import shop_tasks as st
from nemo_gym_browser.local import tiny_policy as tp
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer

SMALL_MODEL = policy_model.ModelSpec(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128)


def one_task_per_kind(path: Path) -> Path:
    """A task file with the first held-back task of each kind (held-back: the tests never train on training tasks
    they also check, and the file still goes through the preparation like any other)."""
    records = st.task_records("heldback")
    chosen = [next(record for record in records if record["kind"] == kind) for kind in st.KINDS]
    path.write_text("".join(json.dumps(record) + "\n" for record in chosen), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def policy_tokenizer():
    return policy_model.policy_tokenizer()


@pytest.fixture(scope="module")
def small_tasks(tmp_path_factory):
    return one_task_per_kind(tmp_path_factory.mktemp("tasks") / "tasks.jsonl")


@pytest.fixture(scope="module")
def demonstrations(policy_tokenizer, small_tasks, tmp_path_factory):
    samples = warm_start.load_samples(small_tasks, tmp_path_factory.mktemp("rows"))
    return asyncio.run(
        warm_start.collect_demonstrations(policy_tokenizer, samples, correct=1.0, per_task=2, seed=0)
    ), samples


@pytest.fixture(scope="module")
def warm_policy(small_tasks, tmp_path_factory):
    """A small policy warm-started just long enough to speak the first turn of every episode."""
    folder = tmp_path_factory.mktemp("policy")
    warm = warm_start.WarmStartSpec(correct=1.0, demos_per_task=2, steps=200, batch_size=2, lr=1e-2, warmup_steps=10)
    report = tp.build(folder, model_spec=SMALL_MODEL, warm=warm, task_file=small_tasks)
    return folder, report


def test_the_policy_tokenizer_says_every_item_in_one_token_and_keeps_the_test_tokenizers_template(policy_tokenizer):
    assert policy_tokenizer.chat_template == build_chat_tokenizer().chat_template
    assert policy_tokenizer.eos_token == "<|im_end|>"
    for item in st.items():
        for text, piece in ((f" open {item.name}.", f" {item.name}"), (f'for "{item.slug}".', item.slug)):
            pieces = [policy_tokenizer.decode([token]) for token in policy_tokenizer(text)["input_ids"]]
            assert piece in pieces, (text, pieces)
    # the default test tokenizer is untouched by the extra corpus
    assert len(build_chat_tokenizer()) != len(policy_tokenizer)


def test_demonstrations_are_the_loops_own_token_sequences_and_solve_their_tasks(demonstrations, policy_tokenizer):
    demos, samples = demonstrations
    assert len(demos) == 2 * len(samples) == 8
    assert all(demo.reward == 1.0 for demo in demos)
    for demo in demos:
        prompt = policy_tokenizer.decode(demo.prompt_ids)
        assert prompt.startswith("<|im_start|>system\nYou are a web agent.") and prompt.endswith("assistant\n")
        assert len(demo.response_mask) == len(demo.response_ids)
        model_text = policy_tokenizer.decode(
            [t for t, m in zip(demo.response_ids, demo.response_mask, strict=True) if m]
        )
        tool_text = policy_tokenizer.decode(
            [t for t, m in zip(demo.response_ids, demo.response_mask, strict=True) if not m]
        )
        assert model_text.count("<tool_call>") == model_text.count("<|im_end|>") >= 3
        assert "<tool_response>" in tool_text and "<tool_call>" not in tool_text and "TITLE:" in tool_text


def test_a_stepwise_demonstration_is_one_sample_per_step_over_the_prompt_that_mode_shows(policy_tokenizer, tmp_path):
    tasks = tmp_path / "aisle.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in st.task_records("heldback", suite="aisle")[:2]))
    samples = warm_start.load_samples(tasks, tmp_path / "rows")
    demos = asyncio.run(
        warm_start.collect_demonstrations(
            policy_tokenizer, samples, correct=1.0, per_task=1, seed=0, sample_modes=("trajectory", "stepwise")
        )
    )
    by_mode = {mode: [d for d in demos if d.sample_mode == mode] for mode in ("trajectory", "stepwise")}
    assert len(by_mode["trajectory"]) == 2 and len(by_mode["stepwise"]) == 2 * 3  # observe, click, finish
    assert all(demo.reward == 1.0 for demo in demos)
    for demo in by_mode["stepwise"]:
        assert demo.response_mask == [1] * len(demo.response_ids)  # the step's own turn, nothing else
        assert policy_tokenizer.decode(demo.response_ids).count("<tool_call>") == 1
    last = policy_tokenizer.decode(by_mode["stepwise"][2].prompt_ids)
    assert STEP_HISTORY_HEADER.format(steps=2) in last and last.count("TITLE:") == 1  # only the stand's observation
    with pytest.raises(ValueError, match="sample modes"):
        asyncio.run(warm_start.collect_demonstrations(policy_tokenizer, samples, correct=1.0, per_task=1, seed=0,
                                                      sample_modes=("episode",)))  # fmt: skip


def test_the_warm_start_learns_only_the_models_tokens_and_its_shared_prefix_loss_is_the_plain_loss(
    demonstrations, policy_tokenizer
):
    demos, _ = demonstrations
    input_ids, attention, labels = warm_start._batch(demos[:3], policy_tokenizer.pad_token_id)
    assert int((labels != -100).sum()) == sum(sum(demo.response_mask) for demo in demos[:3])
    model = policy_model.build_model(policy_tokenizer, SMALL_MODEL, seed=0)
    prefix = warm_start.common_prefix_length(demos)
    assert prefix > 400  # the system prompt and the tools
    with torch.no_grad():
        plain = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        shared = warm_start.demonstration_loss(model, demos[:3], policy_tokenizer.pad_token_id, prefix)
    assert float(shared) == pytest.approx(float(plain), rel=1e-5)


def test_the_warm_started_folder_loads_in_verl_and_its_greedy_first_turn_is_a_browser_call(warm_policy):
    folder, report = warm_policy
    assert report.losses[-1] < report.losses[0] / 4
    assert json.loads((folder / tp.REPORT_FILE).read_text())["parameters"] == report.parameters
    config = HFModelConfig(path=str(folder))
    assert config.hf_config.model_type == "qwen2" and config.tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == report.parameters

    samples = warm_start.load_samples(one_task_per_kind(folder / "check.jsonl"), folder / "rows")
    results = asyncio.run(
        policy_evaluation.evaluate(folder, {"heldback": samples}, temperatures=(0.0,), max_assistant_turns=1)
    )
    (greedy,) = results
    assert greedy.episodes == 4
    assert greedy.tool_call_rate == 1.0  # every first turn: <tool_call>{"name": "browser", ...}</tool_call>


def test_the_builder_gives_the_same_weights_for_the_same_seed_and_others_for_another(small_tasks, tmp_path):
    warm = warm_start.WarmStartSpec(demos_per_task=1, steps=2, batch_size=2)
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        tp.build(
            tmp_path / name, model_spec=SMALL_MODEL, warm=dataclasses.replace(warm, seed=seed), task_file=small_tasks
        )
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert any(not torch.equal(a[key], c[key]) for key in a)


def test_the_command_line_explains_itself_and_refuses_bad_settings(capsys, tmp_path):
    with pytest.raises(SystemExit) as raised:
        tp.main(["--help"])
    assert raised.value.code == 0
    assert "tiny_policy build --output" in capsys.readouterr().out
    for argv in (
        ["build", "--output", str(tmp_path), "--hidden-size", "30", "--heads", "4"],
        ["build", "--output", str(tmp_path), "--correct", "1.5"],
        ["evaluate", "--model", str(tmp_path / "missing")],
        [],
    ):
        with pytest.raises(SystemExit) as raised:
            tp.main(argv)
        assert raised.value.code == 2, argv
