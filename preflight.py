"""Check a composed verl config for this recipe before any GPU is touched: the submit script's last word before Ray.

``submit_webvoyager.sh`` composes the full configuration with ``python -m verl.trainer.main_ppo ... --cfg job`` (which
proves every override key exists) and hands the result to this CLI, which checks what composing cannot: ``paths``,
``verl`` (verl's own ``validate_config``), ``estimator``, ``agent-loop``, ``setting-layers``, ``tools``, ``data``,
``interface``, ``prompts`` and ``judge``. With ``--ray-workers`` (once the Ray cluster is up) it runs instead one
check on every alive node of what a Ray worker there sees (the drop switch, the recipe, the estimator, the judge key
variable; with ``--probe-judge`` the judge endpoint from that node).

Each failure says what to change; nothing here starts a server or uses a GPU. Exit codes: 0 every check passed, 1 a
check failed, 2 usage or unreadable input. What each check looks at: ``docs/cluster-guide.md#the-preflight``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import ipaddress
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nemo_gym_browser.settings import DROP_INVALID_ENV

# verl's own default model path: seeing it means the script's model override did not arrive.
VERL_PLACEHOLDER_MODEL = "~/models/deepseek-llm-7b-chat"
# The trainer config submit_webvoyager.sh composes: its nemo_gym_browser section as written, before overrides.
TRAINER_YAML = Path(__file__).resolve().parent / "configs" / "webvoyager_grpo.yaml"
JUDGE_PROBE_TIMEOUT_S = 15.0
# Connecting a driver and starting one worker per node takes seconds; a node that cannot run a task in this long
# will not run rollouts either.
RAY_PROBE_TIMEOUT_S = 180.0
# Prompts are rendered one by one on the CPU; beyond this many rows a sample is representative and keeps this fast.
MAX_PROMPTS_RENDERED = 2000

EXAMPLES = """\
examples:
  python -m verl.trainer.main_ppo --config-path=$PWD/configs --config-name=webvoyager_grpo OVERRIDES... \\
      --cfg job > composed.yaml
  python preflight.py --config composed.yaml
  python preflight.py --config composed.yaml --probe-judge
  python preflight.py --config composed.yaml --probe-judge --judge-on-every-node   # a judge on 127.0.0.1 per node
  RAY_ADDRESS=127.0.0.1:6379 python preflight.py --config composed.yaml --ray-workers --probe-judge

exit codes: 0 all checks passed, 1 a check failed, 2 usage or unreadable input
"""


class CheckFailed(Exception):
    """A check found something to fix before the run."""


@dataclass(frozen=True)
class RowFacts:
    """What the later checks need to know of one dataset row."""

    location: str  # file:line (the recipe's dataset), else "<split> row <index>"
    needs_judge: bool  # no verifier_metadata: only the judge can score its episodes
    tool_names: tuple[str, ...] | None  # the tools its prompt teaches; None when the row names none


class Context:
    """What the checks share: the composed config, the command line's statements, and what earlier checks built."""

    def __init__(self, config: Any, probe_judge: bool, judge_on_every_node: bool = False):
        self.config = config
        self.probe_judge = probe_judge
        self.judge_on_every_node = judge_on_every_node
        self.settings: Any = None
        self.tool_schemas: list[dict[str, Any]] = []
        self.prompts: list[list[dict[str, Any]]] = []
        self.rows: list[RowFacts] = []
        self.tokenizer: Any = None


def _model_path(ctx: Context) -> str:
    return str(ctx.config.actor_rollout_ref.model.path)


def _local_model_dir(ctx: Context) -> Path | None:
    path = Path(os.path.expanduser(_model_path(ctx)))
    return path if path.is_dir() else None


def check_paths(ctx: Context) -> str:
    from omegaconf import OmegaConf

    rollout = ctx.config.actor_rollout_ref.rollout
    problems = []
    for key, value in (
        ("actor_rollout_ref.rollout.agent.agent_loop_config_path", rollout.agent.agent_loop_config_path),
        ("actor_rollout_ref.rollout.multi_turn.tool_config_path", rollout.multi_turn.tool_config_path),
    ):
        if not value:
            problems.append(f"{key} is not set")
        elif not os.path.isabs(str(value)):
            problems.append(f"{key}={value} must be absolute: Ray workers resolve it in another working directory")
        elif not os.path.isfile(str(value)):
            problems.append(f"{key}={value} does not exist")
    if not rollout.multi_turn.enable:
        problems.append("actor_rollout_ref.rollout.multi_turn.enable must be true for browser episodes")
    if OmegaConf.is_missing(ctx.config, "nemo_gym_browser") or OmegaConf.is_missing(
        ctx.config.nemo_gym_browser.environment, "server_urls"
    ):
        problems.append("nemo_gym_browser.environment.server_urls is not set")
    if _model_path(ctx) == VERL_PLACEHOLDER_MODEL:
        problems.append("actor_rollout_ref.model.path is verl's placeholder: set MODEL_PATH")
    if problems:
        raise CheckFailed("; ".join(problems))
    return f"config paths absolute and present, model {_model_path(ctx)}"


def check_verl(ctx: Context) -> str:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        with warnings.catch_warnings():  # "Disabled critic as algorithm.adv_estimator != gae": intended for GRPO
            warnings.simplefilter("ignore", UserWarning)
            validate_config(
                config=ctx.config,
                use_reference_policy=need_reference_policy(ctx.config),
                use_critic=need_critic(ctx.config),
            )
    except (AssertionError, ValueError, TypeError) as exc:
        raise CheckFailed(f"verl's validate_config: {exc}") from exc
    trainer = ctx.config.trainer
    return f"validate_config passed for {trainer.nnodes} node(s) x {trainer.n_gpus_per_node} GPU(s)"


def check_estimator(ctx: Context) -> str:
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    name = str(ctx.config.algorithm.adv_estimator)
    if name == "gae":
        return "gae (verl's own)"
    try:
        get_adv_estimator_fn(name)
    except ValueError as exc:
        raise CheckFailed(
            f"advantage estimator {name!r} is not registered in a fresh process: install the recipe "
            "(pip install -e <recipe>) or put the recipe folder on PYTHONPATH (its sitecustomize.py registers it)"
        ) from exc
    return f"{name} registered"


def _agent_loop_entry(ctx: Context) -> dict[str, Any]:
    """The default agent loop's entry of the agent-loop YAML."""
    from omegaconf import OmegaConf

    agent = ctx.config.actor_rollout_ref.rollout.agent
    entries = OmegaConf.to_container(OmegaConf.load(str(agent.agent_loop_config_path)), resolve=True)
    if not isinstance(entries, list):
        raise CheckFailed(f"{agent.agent_loop_config_path} must be a YAML list of {{name, _target_, ...}}")
    by_name = {entry.get("name"): entry for entry in entries if isinstance(entry, dict)}
    entry = by_name.get(agent.default_agent_loop)
    if entry is None:
        raise CheckFailed(
            f"default_agent_loop {agent.default_agent_loop!r} is not in {agent.agent_loop_config_path} "
            f"(it has {sorted(name for name in by_name if name)})"
        )
    return entry


def _resolve_settings(ctx: Context, entry: dict[str, Any]) -> Any:
    """The loop's settings as every AgentLoopWorker builds them: YAML kwargs, the trainer config's section on top."""
    from nemo_gym_browser.settings import resolve_settings

    kwargs = {key: value for key, value in entry.items() if key not in ("name", "_target_")}
    try:
        return resolve_settings(kwargs, ctx.config)
    except (ValueError, TypeError) as exc:
        raise CheckFailed(f"agent-loop settings (YAML + nemo_gym_browser section): {exc}") from exc


def check_agent_loop(ctx: Context) -> str:
    from hydra.utils import get_class

    agent = ctx.config.actor_rollout_ref.rollout.agent
    entry = _agent_loop_entry(ctx)
    try:
        get_class(entry["_target_"])
    except Exception as exc:  # hydra wraps import errors in several types
        raise CheckFailed(f"agent loop class {entry.get('_target_')!r} does not import: {exc}") from exc
    ctx.settings = _resolve_settings(ctx, entry)
    urls = ", ".join(ctx.settings.environment.server_urls)
    judge = f"judge {ctx.settings.judge.model}" if ctx.settings.judge else "no judge"
    return f"{agent.default_agent_loop} ({entry['_target_']}); servers {urls}; {judge}"


def check_setting_layers(ctx: Context, trainer_yaml: Path = TRAINER_YAML) -> str:
    """No setting given in one place and silently replaced by a later one (``settings.setting_conflicts``): the
    agent-loop YAML's keys against the composed ``nemo_gym_browser`` section, and ``trainer_yaml``'s section (as
    written) against the config.env values that replace it on every run."""
    import yaml
    from omegaconf import OmegaConf

    from nemo_gym_browser.settings import TRAINER_CONFIG_SECTION, setting_conflicts

    entry = _agent_loop_entry(ctx)
    kwargs = {key: value for key, value in entry.items() if key not in ("name", "_target_")}
    written = yaml.safe_load(trainer_yaml.read_text(encoding="utf-8")) if trainer_yaml.is_file() else None
    written_section = (written or {}).get(TRAINER_CONFIG_SECTION) or {}
    composed = ctx.config.get(TRAINER_CONFIG_SECTION)
    composed_section = OmegaConf.to_container(composed, resolve=True) if composed is not None else {}
    conflicts = setting_conflicts(kwargs, written_section, composed_section)
    if conflicts:
        raise CheckFailed("; ".join(conflicts))
    if kwargs:
        return f"{len(kwargs)} setting(s) in the agent-loop YAML, none replaced by the trainer config"
    return "each setting comes from one place (the agent-loop YAML holds only name and _target_)"


def check_tools(ctx: Context) -> str:
    from verl.tools.tool_registry import load_all_tools

    multi_turn = ctx.config.actor_rollout_ref.rollout.multi_turn
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # verl prints every schema it loads
            tools = load_all_tools(tool_config_path=str(multi_turn.tool_config_path), function_tool_path=None)
    except Exception as exc:  # verl raises whatever the tool class or the YAML raises
        raise CheckFailed(f"verl could not load {multi_turn.tool_config_path}: {exc}") from exc
    if not tools:
        raise CheckFailed(f"{multi_turn.tool_config_path} declares no tools")
    ctx.tool_schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]
    return "tools " + ", ".join(tool.name for tool in tools)


# The turn budget, in tokens. Observations at the server's caps measured 3.18 (real server) and 3.21 (render worst
# case) characters per token with a Qwen2.5 tokenizer (bench/observation_lengths.py); smaller pages are a few hundred
# characters. verl's hermes tool turn around an observation measured 14 tokens; a tool call with a sentence 18-56.
OBSERVATION_CHARS_PER_TOKEN = 3.0
TOOL_TURN_TOKENS = 14
ACTION_TOKENS = 200


def episode_token_budget(turns: int, max_tool_response_length: int) -> int:
    """Tokens an episode of ``turns`` assistant turns can reach: each turn's action, and an observation cut to
    ``max_tool_response_length`` characters after every turn but the last (the episode ends there)."""
    observation = math.ceil(max_tool_response_length / OBSERVATION_CHARS_PER_TOKEN) + TOOL_TURN_TOKENS
    return turns * ACTION_TOKENS + (turns - 1) * observation


def check_turn_budget(ctx: Context) -> str:
    multi_turn = ctx.config.actor_rollout_ref.rollout.multi_turn
    turns, observation_chars = int(multi_turn.max_assistant_turns), int(multi_turn.max_tool_response_length)
    response_length = int(ctx.config.data.max_response_length)
    needed = episode_token_budget(turns, observation_chars)
    if needed > response_length:
        # A warning, not a refusal: small pages keep episodes far below the worst case this assumes.
        fitting = [t for t in range(1, turns) if episode_token_budget(t, observation_chars) <= response_length]
        turns_fix = f"MAX_ASSISTANT_TURNS to at most {fitting[-1]} or " if fitting else ""
        return (
            f"WARNING: {turns} assistant turns can reach {needed} tokens ({ACTION_TOKENS} per action, observations "
            f"of up to {observation_chars} characters at {OBSERVATION_CHARS_PER_TOKEN} characters per token) but the "
            f"response length (MAX_RESPONSE_LENGTH) is {response_length}: episodes on large pages will be cut before "
            f"their last turns; set {turns_fix}MAX_RESPONSE_LENGTH to at least {needed}"
        )
    return f"{turns} turns need at most {needed} of {response_length} response tokens"


def _load_rows(ctx: Context, dataset_cls: Any, files: Any, tokenizer: Any) -> Any:
    from omegaconf import ListConfig

    data_files = list(files) if isinstance(files, list | tuple | ListConfig) else [str(files)]
    missing = [path for path in data_files if not os.path.isfile(os.path.expanduser(str(path)))]
    if missing:
        raise CheckFailed(f"data file(s) missing: {missing}")
    try:
        return dataset_cls(data_files=data_files, tokenizer=tokenizer, processor=None, config=ctx.config.data)
    except Exception as exc:  # the dataset names the file and line of a bad row
        raise CheckFailed(f"{dataset_cls.__name__} rejected {data_files}: {exc}") from exc


def row_facts(sample: dict[str, Any], fallback_location: str) -> RowFacts:
    """What the checks need of one dataset sample; CheckFailed, at the row's location, when the agent loop could not
    read its episode or its ``verifier_metadata`` breaks the one rule (a custom dataset class may not apply it)."""
    from nemo_gym_browser.agent_attempt.episode import EpisodeSpec
    from nemo_gym_browser.dataset import row_tool_names
    from nemo_gym_browser.gym_contract.rows import RowValueError, validate_verifier_metadata

    extra_info = sample.get("extra_info")
    location = extra_info.get("source") if isinstance(extra_info, dict) else None
    location = str(location or fallback_location)
    try:
        spec = EpisodeSpec.from_tools_kwargs(sample.get("tools_kwargs"))
    except ValueError as exc:
        raise CheckFailed(f"{location}: the agent loop cannot read this row's episode: {exc}") from exc
    try:
        verifier = validate_verifier_metadata(spec.verifier_metadata)
    except RowValueError as exc:
        raise CheckFailed(f"{location}: {exc}") from exc
    names = row_tool_names(sample)
    return RowFacts(location, verifier is None, None if names is None else tuple(names))


def check_data(ctx: Context) -> str:
    from verl.utils.dataset.rl_dataset import get_dataset_class

    data = ctx.config.data
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # verl prints the class it picked
            dataset_cls = get_dataset_class(data)
    except Exception as exc:  # import errors, or a class that is no torch Dataset
        where = f"{data.custom_cls.path}:{data.custom_cls.name}"
        raise CheckFailed(f"data.custom_cls {where} does not load: {exc}") from exc
    train = _load_rows(ctx, dataset_cls, data.train_files, ctx.tokenizer)
    val = _load_rows(ctx, dataset_cls, data.val_files, ctx.tokenizer)
    if len(train) < data.train_batch_size:
        raise CheckFailed(
            f"{len(train)} train rows < data.train_batch_size={data.train_batch_size}: no full batch (verl drops "
            "the last incomplete batch), so the run would have no training step"
        )
    for split, dataset in (("train", train), ("val", val)):
        for index in range(len(dataset)):
            sample = dataset[index]
            if index < MAX_PROMPTS_RENDERED:
                ctx.prompts.append(sample["raw_prompt"])
            ctx.rows.append(row_facts(sample, f"{split} row {index}"))
    steps = len(train) // data.train_batch_size
    return f"{dataset_cls.__name__}: {len(train)} train rows ({steps} step(s) per epoch), {len(val)} val rows"


def _interface(names: Any) -> str:
    """How the user chose a tool set: ``browser``/``native`` for the recipe's two, else the names themselves."""
    from nemo_gym_browser.task_lists.task_rows import tool_interface_of

    return tool_interface_of(names) or str(sorted(names))


def check_interface(ctx: Context) -> str:
    tool_config = ctx.config.actor_rollout_ref.rollout.multi_turn.tool_config_path
    given = [schema["function"]["name"] for schema in ctx.tool_schemas]
    named = [row for row in ctx.rows if row.tool_names is not None]
    foreign = [row for row in named if not set(row.tool_names) <= set(given)]
    if foreign:
        first = foreign[0]
        taught, configured = _interface(first.tool_names), _interface(given)
        raise CheckFailed(
            f"{len(foreign)} of {len(ctx.rows)} rows teach the tools of --tool-interface {taught} "
            f"{list(first.tool_names)}, but {tool_config} gives the model the tools of TOOL_INTERFACE={configured} "
            f'{given} (first at {first.location}): every call the prompt teaches would be an "Unknown function" '
            f"error, scored as an ordinary policy zero. Set TOOL_INTERFACE={taught}, or prepare the data again with "
            f"prepare_webvoyager_data.py --tool-interface {configured}"
        )
    if not named:
        return f"not checked: none of the {len(ctx.rows)} rows names its tools (responses_create_params.tools)"
    unnamed = len(ctx.rows) - len(named)
    note = f"; {unnamed} row(s) name no tools (not checked)" if unnamed else ""
    return f"{len(named)} rows teach the tools of --tool-interface {_interface(given)}, those of {tool_config}{note}"


def check_prompts(ctx: Context) -> str:
    model_dir = _local_model_dir(ctx)
    if model_dir is None:
        return f"skipped: {_model_path(ctx)} is not a local folder (nothing downloaded here)"
    from transformers import AutoConfig, AutoTokenizer
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    model = ctx.config.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(str(model.get("tokenizer_path") or model_dir))
    model_type = getattr(AutoConfig.from_pretrained(str(model_dir)), "model_type", None)
    if ctx.settings is not None and ctx.settings.token_builder_model_type is not None:
        model_type = ctx.settings.token_builder_model_type  # the loop builds with this one (browser_agent_loop.py)
    chat_template_kwargs = dict(ctx.config.data.get("apply_chat_template_kwargs") or {})
    builder = create_continuous_token_builder(
        tokenizer, hf_model_type=model_type, chat_template_kwargs=chat_template_kwargs
    )
    if not ctx.prompts:
        raise CheckFailed("no prompt to render (the data check did not run)")
    rendered = tokenizer.apply_chat_template(
        ctx.prompts[0], tools=ctx.tool_schemas, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
    )
    names = [schema["function"]["name"] for schema in ctx.tool_schemas]
    absent = [name for name in names if name not in rendered]
    if absent:
        raise CheckFailed(f"the chat template of {model_dir} does not render the tools {absent}: use a tool model")
    limit = int(ctx.config.actor_rollout_ref.rollout.prompt_length)
    lengths = [len(builder.build_initial_tokens(messages, tools=ctx.tool_schemas)) for messages in ctx.prompts]
    too_long = sum(length > limit for length in lengths)
    if too_long:
        raise CheckFailed(
            f"{too_long} of {len(lengths)} prompts exceed rollout.prompt_length={limit} tokens (longest "
            f"{max(lengths)}); verl would cut their head (system prompt, tools): raise MAX_PROMPT_LENGTH"
        )
    longest = max(lengths)
    junction = turn_junction_problem(tokenizer, builder, ctx.prompts[0], ctx.tool_schemas)
    if junction:
        raise CheckFailed(
            f"{junction}: verl chose its token builder by model_type={model_type!r}; if the chat template is another "
            "family's (a converted checkpoint), set nemo_gym_browser.token_builder_model_type to that family's "
            "model_type (e.g. qwen2)"
        )
    return f"chat template renders {len(names)} tool(s); {len(lengths)} prompts fit {limit} tokens (longest {longest})"


def turn_junction_problem(tokenizer: Any, builder: Any, prompt: list[dict[str, Any]], tools: list[dict]) -> str:
    """Empty when verl's token ``builder`` joins a model turn and the tool response after it as the chat template
    renders them; else what differs.

    The model's turn is taken as generated: its text, then the end-of-sequence token it stops at. What the template
    puts after that token (Qwen's templates: a newline) must follow it in the builder's merge too, or every turn
    after the first is a context the model never saw in training.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        return ""
    turn = {"role": "assistant", "content": "ok"}
    response = {"role": "tool", "content": "page text"}
    kwargs = {"tools": tools, "add_generation_prompt": True, "tokenize": True}
    rendered = tokenizer.apply_chat_template([*prompt, turn, response], **kwargs)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    generated = builder.build_initial_tokens(prompt, tools=tools)
    generated = [*generated, *tokenizer.encode("ok", add_special_tokens=False), eos]
    merged = builder.merge_context_tokens([*prompt, turn], [*prompt, turn, response], generated, tools=tools)
    merged = list(merged.token_ids)
    cut = len(generated) - 1  # the eos the model stopped at
    if rendered[:cut] != merged[:cut] or eos not in rendered[cut:]:
        return ""  # the template renders the turn itself otherwise (e.g. a thinking block): not this check's case
    after = rendered.index(eos, cut) + 1
    template_next, builder_next = rendered[after : after + 3], merged[cut + 1 : cut + 4]
    if template_next == builder_next:
        return ""
    return (
        f"after a model turn's {tokenizer.decode([eos])!r} the chat template has "
        f"{tokenizer.decode(template_next)!r} but verl's token builder joins {tokenizer.decode(builder_next)!r}"
    )


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` names this machine whatever machine asks (localhost, 127.0.0.0/8, ::1, 0.0.0.0)."""
    host = (urlsplit(url).hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: whether every node reaches it is what the per-node probe finds out
    return address.is_loopback or address.is_unspecified


def probe_judge(base_url: str, model: str, api_key_env: str | None) -> str | None:
    """None when ``GET {base_url}/models`` answers and lists ``model``; else what is wrong (never the key).

    A redirect is reported, never followed: urllib would carry the ``Authorization`` header to wherever it points.
    Whatever the endpoint sends back is shown without the key. Runs in this process and, pickled with this script,
    inside a Ray worker on every node: self-contained on purpose.
    """

    class RefuseRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None  # urllib then raises the 3xx as an HTTPError

    key = ""
    request = urllib.request.Request(base_url.rstrip("/") + "/models")
    if api_key_env:
        key = os.environ.get(api_key_env) or ""
        if not key:
            return f"the judge key variable {api_key_env} is not set"
        request.add_header("Authorization", f"Bearer {key}")

    def shown(text: object) -> str:
        return str(text).replace(key, "***") if key else str(text)

    opener = urllib.request.build_opener(RefuseRedirects)
    try:
        with opener.open(request, timeout=JUDGE_PROBE_TIMEOUT_S) as response:
            body = json.loads(response.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            target = urlsplit(exc.headers.get("Location") or "")
            where = f"{target.scheme}://{target.netloc}" if target.netloc else "a path on the same server"
            return shown(
                f"judge endpoint {base_url}/models redirects (HTTP {exc.code}) to {where}; the probe does not follow "
                "redirects, which would carry the judge key along: set JUDGE_BASE_URL to the address that answers"
            )
        return shown(f"judge endpoint {base_url}/models did not answer (HTTP {exc.code}: {exc.reason})")
    except (urllib.error.URLError, TimeoutError, OSError, ValueError, RecursionError) as exc:
        return shown(f"judge endpoint {base_url}/models did not answer ({type(exc).__name__}: {exc})")
    data = body.get("data") if isinstance(body, dict) else None
    served = [item.get("id") for item in data or [] if isinstance(item, dict)]
    if model not in served:
        return shown(f"judge endpoint {base_url} serves {served}, not {model!r} (JUDGE_MODEL)")
    return None


def check_judge(ctx: Context) -> str:
    judge = ctx.settings.judge if ctx.settings is not None else None
    if judge is None:
        open_ended = [row for row in ctx.rows if row.needs_judge]
        if open_ended:
            raise CheckFailed(
                f"{len(open_ended)} of {len(ctx.rows)} rows have no verifier_metadata, so only a judge can score "
                f"them, and no judge is configured (JUDGE_ENABLE=0); first at {open_ended[0].location}. Configure a "
                "judge (JUDGE_ENABLE=1, JUDGE_BASE_URL, JUDGE_MODEL) or give those tasks verifier_metadata"
            )
        return f"no judge configured; all {len(ctx.rows)} rows have verifier_metadata"
    nodes = int(ctx.config.trainer.nnodes)
    where = ""
    if nodes > 1 and is_loopback_url(judge.base_url):
        if not ctx.judge_on_every_node:
            raise CheckFailed(
                f"the judge URL {judge.base_url} is a loopback address, but this run has {nodes} nodes: rollouts run "
                "on every node and each would call its own node, where no judge runs unless you start one (refused "
                "connections, episodes flagged judge_unusable). Set JUDGE_BASE_URL to an address every node "
                "reaches, or run a judge on every node at that URL and set JUDGE_ON_EVERY_NODE=1 "
                "(docs/cluster-guide.md#the-judge)"
            )
        where = " on every node"
    if not ctx.probe_judge:
        return f"configured ({judge.model} at {judge.base_url}{where}); not probed"
    problem = probe_judge(judge.base_url, judge.model, judge.api_key_env)
    if problem is not None:
        raise CheckFailed(f"{problem}; start it, fix JUDGE_BASE_URL, or set JUDGE_PROBE=0 if it starts later")
    if where:
        return f"{judge.base_url} serves {judge.model} on this node (one per node: Ray workers probe the others' own)"
    return f"{judge.base_url} serves {judge.model}"


def _worker_view(estimator: str, judge_key_env: str | None, judge: tuple[str, str] | None) -> dict[str, Any]:
    """What a Ray worker process sees (runs inside the worker; pickled by value with this script).

    ``judge`` is ``(base_url, model)`` to probe the judge from this node, as the rollouts here will call it.
    """
    import importlib
    import socket

    view: dict[str, Any] = {"host": socket.gethostname(), "drop_switch": os.environ.get(DROP_INVALID_ENV)}
    try:
        importlib.import_module("nemo_gym_browser")
        view["package"] = True
    except ImportError:
        view["package"] = False
    try:
        from verl.trainer.ppo.core_algos import get_adv_estimator_fn

        get_adv_estimator_fn(estimator)
        view["estimator"] = True
    except (ImportError, ValueError):
        view["estimator"] = False
    view["judge_key"] = bool(os.environ.get(judge_key_env)) if judge_key_env else None
    view["judge_problem"] = probe_judge(judge[0], judge[1], judge_key_env) if judge is not None else None
    return view


def check_ray_workers(ctx: Context) -> str:
    """One task pinned to every alive node. Connects to ``RAY_ADDRESS`` (and disconnects after), or uses the
    connection this process already has."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    judge = ctx.settings.judge if ctx.settings is not None else _resolve_settings(ctx, _agent_loop_entry(ctx)).judge
    judge_key_env = judge.api_key_env if judge is not None else None
    judge_probe = (judge.base_url, judge.model) if judge is not None and ctx.probe_judge else None
    estimator = str(ctx.config.algorithm.adv_estimator)
    expected_switch = os.environ.get(DROP_INVALID_ENV)
    connect = not ray.is_initialized()
    if connect:
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            raise CheckFailed("RAY_ADDRESS is not set: start the Ray cluster first")
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [node for node in ray.nodes() if node["Alive"]]
        probe = ray.remote(num_cpus=0)(_worker_view)
        refs = [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                estimator, judge_key_env, judge_probe
            )
            for node in nodes
        ]
        try:
            views = ray.get(refs, timeout=RAY_PROBE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as exc:
            raise CheckFailed(f"a Ray node ran no task within {RAY_PROBE_TIMEOUT_S:.0f} s") from exc
    finally:
        if connect:
            ray.shutdown()
    exports, unreachable = [], []
    for view in views:
        host = view["host"]
        if view["drop_switch"] != expected_switch:
            exports.append(f"{host}: {DROP_INVALID_ENV}={view['drop_switch']!r}, expected {expected_switch!r}")
        if not view["package"]:
            exports.append(f"{host}: nemo_gym_browser does not import in a Ray worker")
        if not view["estimator"]:
            exports.append(f"{host}: estimator {estimator!r} is not registered in a Ray worker")
        if view["judge_key"] is False:
            exports.append(f"{host}: the judge key variable {judge_key_env} is not set in a Ray worker")
        elif view["judge_problem"] is not None:
            unreachable.append(f"{host}: {view['judge_problem']}")
    problems = []
    if exports:
        problems.append("; ".join(exports) + " (export them before `ray start`)")
    if unreachable:
        problems.append(
            "; ".join(unreachable) + " (rollouts on that node call the judge from there: give JUDGE_BASE_URL an "
            "address every node reaches, or run a judge on every node; JUDGE_PROBE=0 if it starts later)"
        )
    if problems:
        raise CheckFailed("; ".join(problems))
    hosts = ", ".join(sorted(view["host"] for view in views))
    judged = f"; judge {judge.model} answers at {judge.base_url} on every node" if judge_probe else ""
    return (
        f"{len(views)} node(s) ({hosts}): {DROP_INVALID_ENV}={expected_switch}, recipe and {estimator} in place"
        + judged
    )


CHECKS: tuple[tuple[str, Callable[[Context], str]], ...] = (
    ("paths", check_paths),
    ("verl", check_verl),
    ("estimator", check_estimator),
    ("agent-loop", check_agent_loop),
    ("setting-layers", check_setting_layers),
    ("tools", check_tools),
    ("turn-budget", check_turn_budget),
    ("data", check_data),
    ("interface", check_interface),
    ("prompts", check_prompts),
    ("judge", check_judge),
)


RAY_CHECKS: tuple[tuple[str, Callable[[Context], str]], ...] = (("ray-workers", check_ray_workers),)


def run_checks(
    config: Any,
    *,
    probe_judge: bool = False,
    judge_on_every_node: bool = False,
    checks: tuple[tuple[str, Callable[[Context], str]], ...] = CHECKS,
) -> list[tuple[str, bool, str]]:
    """Run ``checks`` in order; a check that needs an earlier one's result is skipped if that one failed."""
    ctx = Context(config, probe_judge, judge_on_every_node)
    results: list[tuple[str, bool, str]] = []
    failed: set[str] = set()
    needs = {
        "prompts": {"tools", "data"},
        "interface": {"tools", "data"},
        "data": {"paths"},
        "judge": {"agent-loop", "data"},
        "agent-loop": {"paths"},
        "setting-layers": {"agent-loop"},
    }
    for name, check in checks:
        if needs.get(name, set()) & failed:
            results.append((name, False, f"not run: it needs {sorted(needs[name] & failed)}"))
            failed.add(name)
            continue
        try:
            results.append((name, True, check(ctx)))
        except CheckFailed as exc:
            results.append((name, False, str(exc)))
            failed.add(name)
        except ImportError as exc:
            results.append((name, False, f"{exc}: is the recipe installed (pip install -e <recipe>) or on PYTHONPATH?"))
            failed.add(name)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preflight.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, required=True, help="a config composed by main_ppo --cfg job (YAML)")
    parser.add_argument("--probe-judge", action="store_true", help="ask the judge endpoint for its model list")
    parser.add_argument(
        "--judge-on-every-node",
        action="store_true",
        help="a judge serves the judge URL on every node: allows a loopback judge URL on a multi-node run",
    )
    parser.add_argument(
        "--ray-workers", action="store_true", help="only check what Ray workers on every node see (needs RAY_ADDRESS)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.load(args.config)
    except (OSError, ValueError) as exc:
        print(f"preflight: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    results = run_checks(
        config,
        probe_judge=args.probe_judge,
        judge_on_every_node=args.judge_on_every_node,
        checks=RAY_CHECKS if args.ray_workers else CHECKS,
    )
    for name, ok, detail in results:
        print(f"preflight: {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    failures = sum(not ok for _, ok, _ in results)
    verdict = f"{failures} of {len(results)} checks failed" if failures else f"all {len(results)} checks passed"
    print(f"preflight: {verdict} in {time.monotonic() - started:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
