"""BrowserJSONLDataset: prepared WebVoyager rows through verl's own dataset hook, sampler, collate and batch types."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from tensordict import NonTensorStack
from torchdata.stateful_dataloader import StatefulDataLoader
from verl import DataProto
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn

from nemo_gym_browser import prepare_webvoyager_data as prep
from nemo_gym_browser.agent_attempt.browser_tool import AGENT_LOOP_NAME
from nemo_gym_browser.dataset import EPISODE_TOOLS, BrowserJSONLDataset
from nemo_gym_browser.gym_contract.browser_calls import TOOL_NAMES
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
from nemo_gym_browser.task_lists import task_rows
from nemo_gym_browser.task_lists.tasks import InputError
from nemo_gym_browser.testing.webvoyager import missing_message, webvoyager_dir

REPO = Path(__file__).resolve().parents[1]
WEBVOYAGER = webvoyager_dir()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The real WebVoyager files, prepared by the real command."""
    assert (WEBVOYAGER / "WebVoyager_data.jsonl").is_file(), missing_message(WEBVOYAGER)
    out = tmp_path_factory.mktemp("prepared")
    code = prep.main(
        [
            "--input", str(WEBVOYAGER / "WebVoyager_data.jsonl"),
            "--reference-answers", str(WEBVOYAGER / "reference_answer.json"),
            "--output-dir", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    return out


def data_config(**overrides) -> OmegaConf:
    return OmegaConf.create(
        {
            "custom_cls": {"path": "pkg://nemo_gym_browser.dataset", "name": "BrowserJSONLDataset"},
            "shuffle": True,
            "seed": 3,
            "dataloader_num_workers": 0,
            **overrides,
        }
    )


def nemo_row(**fields) -> dict:
    return {
        "responses_create_params": {
            "input": [{"role": "system", "content": "Browse."}, {"role": "user", "content": "Open the About page."}]
        },
        "initial_url": "https://example.com/",
        **fields,
    }


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_prepared_rows_reach_the_agent_loop_kwargs_through_verls_hook_sampler_and_collate(prepared):
    config = data_config()
    files = OmegaConf.create([str(prepared / "train.jsonl")])  # hydra hands a ListConfig
    dataset = create_rl_dataset(files, config, tokenizer=None, processor=None, max_samples=-1)
    assert isinstance(dataset, BrowserJSONLDataset)
    train_ids = [json.loads(line)["task_id"] for line in (prepared / "train.jsonl").read_text().splitlines()]
    assert len(dataset) == len(train_ids)

    loader = StatefulDataLoader(
        dataset, batch_size=8, collate_fn=collate_fn, sampler=create_rl_sampler(config, dataset), drop_last=True
    )
    batch_dict = next(iter(loader))
    full_batch = DataProto.from_single_dict(batch_dict)
    assert full_batch.batch["dummy_tensor"].shape == (8, 1)
    batch = RayPPOTrainer._get_gen_batch(None, full_batch)  # what the legacy trainer sends to the agent loop

    indices = batch.non_tensor_batch["index"]
    assert sorted(indices.tolist()) != list(range(8))  # the seeded sampler shuffled
    for i in range(8):
        kwargs = {key: value[i] for key, value in batch.non_tensor_batch.items()}  # as AgentLoopWorker does
        assert kwargs["agent_name"] == AGENT_LOOP_NAME
        task_id = kwargs["extra_info"]["task_id"]
        assert task_id == train_ids[kwargs["index"]] == kwargs["tools_kwargs"]["browser"]["create_kwargs"]["task_id"]
        system, user = kwargs["raw_prompt"]
        assert system["role"] == "system" and "`browser`" in system["content"]
        assert user["role"] == "user" and kwargs["extra_info"]["question"] in user["content"]
        assert set(kwargs["tools_kwargs"]) == {"browser", *TOOL_NAMES}
        episode = kwargs["tools_kwargs"]["browser"]["create_kwargs"]
        assert episode["initial_url"].startswith("https://") and episode["verifier_metadata"] is None
        assert episode["task"]["site"] == task_id.rsplit("--", 1)[0]
        assert episode["task"]["reference_type"] in ("golden", "possible") and episode["task"]["reference_answer"]
        assert all(kwargs["tools_kwargs"][tool]["create_kwargs"] == episode for tool in TOOL_NAMES)
        assert kwargs["data_source"] == "webvoyager"
        assert kwargs["reward_model"] == {"style": "model", "ground_truth": episode["task"]["reference_answer"]}
        assert kwargs["extra_info"]["source"].startswith(f"{prepared / 'train.jsonl'}:")


def test_the_v1_trainers_tensordict_carries_every_column_per_sample(prepared):
    dataset = BrowserJSONLDataset(str(prepared / "val.jsonl"), tokenizer=None, config=data_config())
    batch_dict = collate_fn([dataset[i] for i in range(4)])
    # what PPOTrainer._fetch_one_gen_batch does before handing the batch to the agent loop manager
    batch_dict["uid"] = np.array([f"uid-{i}" for i in range(4)], dtype=object)
    batch = tu.get_tensordict(batch_dict)

    for i in range(4):
        # how the V1 agent loop worker (agent_loop_tq.py) reads one sample out of the TensorDict
        prompt = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                prompt[key] = value[i]
            elif isinstance(value, NonTensorStack):
                prompt[key] = value[i].data
        assert prompt["uid"] == f"uid-{i}" and prompt["index"] == i
        assert prompt["agent_name"] == AGENT_LOOP_NAME
        assert prompt["raw_prompt"] == dataset[i]["raw_prompt"]
        assert prompt["tools_kwargs"]["browser"]["create_kwargs"]["task_id"] == dataset[i]["extra_info"]["task_id"]
        assert prompt["agent_ref"] is None


class RecordingTool(BaseTool):
    """A verl BaseTool that records the create_kwargs ToolAgentLoop hands it and answers with a fixed text."""

    def __init__(self, name: str):
        schema = {
            "type": "function",
            "function": {"name": name, "description": "", "parameters": {"type": "object", "properties": {}}},
        }
        super().__init__({}, OpenAIFunctionToolSchema.model_validate(schema))
        self.created: list[dict] = []

    async def create(self, instance_id=None, **kwargs):
        self.created.append(kwargs["create_kwargs"])
        return "instance", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="page"), 0.0, {}


@pytest.mark.parametrize("tool_name", ["browser", "browser_observe"])
async def test_verls_tool_call_hands_the_episode_to_either_tool_interface(prepared, tool_name):
    dataset = BrowserJSONLDataset([str(prepared / "val.jsonl")])
    sample = collate_fn([dataset[0]])
    tool = RecordingTool(tool_name)
    owner = SimpleNamespace(tools={tool_name: tool}, max_tool_response_length=1000, tool_response_truncate_side="right")

    response, _, _ = await ToolAgentLoop._call_tool(
        owner, FunctionCall(name=tool_name, arguments="{}"), sample["tools_kwargs"][0], SimpleNamespace()
    )

    assert response.text == "page"
    assert tool.created == [dataset[0]["tools_kwargs"]["browser"]["create_kwargs"]]
    assert tool.created[0]["task_id"] == dataset[0]["extra_info"]["task_id"]


def test_a_checkpointed_dataloader_resumes_with_the_next_batch(prepared):
    config = data_config()
    dataset = BrowserJSONLDataset([str(prepared / "train.jsonl")], config=config)

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(
            dataset, batch_size=16, collate_fn=collate_fn, sampler=create_rl_sampler(config, dataset), num_workers=1
        )

    first = loader()
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    expected = next(iterator)["index"].tolist()

    resumed = loader()
    resumed.load_state_dict(state)
    assert next(iter(resumed))["index"].tolist() == expected


def test_the_prompt_renders_with_a_chat_template_and_the_browser_tool(prepared):
    tokenizer = build_chat_tokenizer()
    dataset = BrowserJSONLDataset([str(prepared / "val.jsonl")])
    schema = task_rows.BROWSER_TOOL_SCHEMAS[0]
    tools = [{"type": "function", "function": {key: schema[key] for key in ("name", "description", "parameters")}}]

    text = tokenizer.apply_chat_template(
        dataset[0]["raw_prompt"], tools=tools, add_generation_prompt=True, tokenize=False
    )

    assert dataset[0]["extra_info"]["question"] in text and '"name": "browser"' in text


def test_samples_are_fresh_copies(prepared):
    dataset = BrowserJSONLDataset([str(prepared / "val.jsonl")])
    sample = dataset[0]
    sample["raw_prompt"].append({"role": "assistant", "content": "x"})
    sample["tools_kwargs"]["browser"]["create_kwargs"]["task_id"] = "changed"

    again = dataset[0]
    assert len(again["raw_prompt"]) == 2
    assert again["tools_kwargs"]["browser"]["create_kwargs"]["task_id"] == again["extra_info"]["task_id"]


def test_max_samples_keeps_the_first_rows_or_a_seeded_choice(prepared):
    files = [str(prepared / "train.jsonl")]
    first = BrowserJSONLDataset(files, config=data_config(shuffle=False), max_samples=5)
    assert [first[i]["extra_info"]["source"].rsplit(":", 1)[1] for i in range(5)] == ["1", "2", "3", "4", "5"]

    chosen = [BrowserJSONLDataset(files, config=data_config(), max_samples=5) for _ in range(2)]
    ids = [[ds[i]["extra_info"]["task_id"] for i in range(5)] for ds in chosen]
    assert ids[0] == ids[1] and ids[0] != [first[i]["extra_info"]["task_id"] for i in range(5)]
    assert [chosen[0][i]["index"] for i in range(5)] == list(range(5))


def test_nemo_gym_rows_keep_their_verifier_agent_ref_and_extra_fields(tmp_path):
    rows = [
        nemo_row(
            responses_create_params={
                "input": [
                    {"role": "developer", "content": "Use the browser.", "type": "message"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "Read the "},
                            {"type": "input_text", "text": "code."},
                        ],
                    },
                ],
                "tools": [{"type": "function", "name": "browser_observe"}],
                "temperature": 0.2,
            },
            verifier_metadata={"answer_equals": "ALPHA-42", "url_contains": None},
            agent_ref={"type": "responses_api_agents", "name": "interactive_browser_simple_agent"},
            difficulty="easy",
        ),
        nemo_row(task_id="about", site="example.com"),
    ]  # fmt: skip
    dataset = BrowserJSONLDataset([str(write_jsonl(tmp_path / "rows.jsonl", rows))])
    first, second = dataset[0], dataset[1]

    assert first["raw_prompt"] == [
        {"role": "system", "content": "Use the browser."},
        {"role": "user", "content": "Read the code."},
    ]
    episode = first["tools_kwargs"]["browser"]["create_kwargs"]
    assert episode["verifier_metadata"] == {"answer_equals": "ALPHA-42"}
    assert episode["task_id"].startswith("row-") and episode["task"]["question"] == "Read the code."
    assert first["reward_model"] == {"style": "rule", "ground_truth": None}
    assert first["agent_ref"] == rows[0]["agent_ref"]
    assert first["extra_env_info"]["difficulty"] == "easy"
    assert first["extra_env_info"]["_rcp_extra"] == {"tools": [{"type": "function", "name": "browser_observe"}]}
    assert first["data_source"] == "nemo_gym"
    assert second["tools_kwargs"]["browser_finish"]["create_kwargs"]["task_id"] == "about"
    assert second["extra_info"]["site"] == "example.com" and second["agent_ref"] is None

    batch = collate_fn([first, second])  # rows with and without optional fields still make whole columns
    assert all(len(column) == 2 for column in batch.values())
    assert set(EPISODE_TOOLS) == set(batch["tools_kwargs"][1])


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([nemo_row(), "{oops"], "rows.jsonl:2: malformed JSON"),
        (
            [nemo_row(), "", {"id": "A--1", "ques": "q", "web": "https://a.example/"}],
            "rows.jsonl:3: not a NeMo Gym row",
        ),
        ([nemo_row(verifier_metadata={"dom_contain": "x"})], "rows.jsonl:1: unknown verifier_metadata keys"),
        (
            [nemo_row(verifier_metadata={"dom_contains": "x", "final_url": "y"})],
            "rows.jsonl:1: verifier_metadata has 2 grading keys ['final_url', 'dom_contains'], but the server grades",
        ),
        ([nemo_row(responses_create_params={"input": []})], "rows.jsonl:1: 'responses_create_params.input' must be"),
        ([nemo_row(task_id="a"), nemo_row(task_id="a")], "rows.jsonl:2: duplicate task id 'a' (first at"),
        (["", "  "], "no rows in"),
    ],
)
def test_a_malformed_row_is_reported_with_its_file_and_line(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "rows.jsonl", lines)
    with pytest.raises(InputError) as raised:
        BrowserJSONLDataset([str(path)])
    assert message in str(raised.value)
    assert str(path) in str(raised.value)


def test_the_same_task_in_two_files_is_refused(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [nemo_row(task_id="t1")])
    b = write_jsonl(tmp_path / "b.jsonl", [nemo_row(task_id="t2"), nemo_row(task_id="t1")])
    with pytest.raises(InputError, match=r"b\.jsonl:2: duplicate task id 't1' \(first at .*a\.jsonl:1\)"):
        BrowserJSONLDataset([str(a), str(b)])


def test_the_agent_loop_reads_the_episode_this_dataset_writes(prepared):
    from nemo_gym_browser.agent_attempt.episode import EpisodeSpec

    dataset = BrowserJSONLDataset([str(prepared / "val.jsonl")])
    column = collate_fn([dataset[i] for i in range(3)])["tools_kwargs"]

    for i in range(3):
        spec = EpisodeSpec.from_tools_kwargs(column[i])
        info = dataset[i]["extra_info"]
        assert (spec.task_id, spec.initial_url, spec.verifier_metadata) == (info["task_id"], info["initial_url"], None)
        assert (spec.question, spec.reference_answer) == (info["question"], info["reference_answer"])


@pytest.mark.parametrize(
    ("interface", "config_file"), [("browser", "browser_tool.yaml"), ("native", "browser_native_tools.yaml")]
)
def test_the_tools_a_row_describes_are_the_recipes_tool_config_word_for_word(interface, config_file):
    schemas = task_rows.BROWSER_TOOL_SCHEMAS if interface == "browser" else task_rows.NATIVE_TOOL_SCHEMAS
    configured = [
        tool["tool_schema"]["function"]
        for tool in yaml.safe_load((REPO / "configs" / config_file).read_text())["tools"]
    ]

    assert [{key: value for key, value in tool.items() if key != "type"} for tool in schemas] == configured
    assert {tool["type"] for tool in schemas} == {"function"}
