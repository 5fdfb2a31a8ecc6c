"""verl's own vLLM rollout on CPU (``local/vllm_cpu``) and the policy shape vLLM's CPU build serves (``wide_heads``).

The first tests need no vLLM: the widened policy's logits against the original's, the version checks' messages,
the settings composing with verl's config, the /dev/shm clean-up. The ``vllm_cpu`` tests run
``python -m nemo_gym_browser.local.vllm_cpu.check`` with ``.venv-vllm``'s interpreter (``scripts/setup_vllm.sh``)
and are skipped where that venv does not exist: verl's ``vLLMHttpServer`` on CPU, synced from a Hugging Face actor,
must serve the actor's log-probs, take a step's change, fail the check after a sync that changes nothing, and raise
on a broken sync instead of hanging. ``python -m nemo_gym_browser.local.vllm_cpu.loop_check`` drives the same server
through verl's own ``LLMServerClient``: a generation cut by ``generate_within`` must stop decoding there, and the
recipe's hermes parser must read the tool calls vLLM generates for the deal policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_gym_browser.local import vllm_cpu
from nemo_gym_browser.local.tiny_policy import DEAL_POLICY_DIR
from nemo_gym_browser.local.wide_heads import LOGIT_TOLERANCE, max_logit_gap, widen_heads

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# scripts/test.sh sets this for its vLLM tier: there a missing venv is a failure, not a skip.
REQUIRE_VLLM = os.environ.get("NEMO_GYM_BROWSER_REQUIRE_VLLM") == "1"
needs_vllm_venv = pytest.mark.skipif(
    not VLLM_PYTHON.exists() and not REQUIRE_VLLM,
    reason=".venv-vllm does not exist (bash scripts/setup_vllm.sh creates it)",
)


@pytest.fixture(scope="module")
def wide_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return widen_heads(DEAL_POLICY_DIR, tmp_path_factory.mktemp("policy") / "deal-head32", head_dim=32)


# ----- the widened policy


def test_widened_deal_policy_computes_the_same_logits(wide_policy: Path) -> None:
    config = json.loads((wide_policy / "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["attention_bias"]) == ("granite", 32, True)
    assert config["attention_multiplier"] == 16**-0.5  # the original heads' scale, not the wide heads'
    assert config["widened_from_model_type"] == "qwen2"  # its chat template's family (the token builder's)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, config["vocab_size"], (n,), generator=generator).tolist() for n in (3, 50, 400)]
    assert max_logit_gap(DEAL_POLICY_DIR, wide_policy, sequences) < LOGIT_TOLERANCE
    # the tokenizer and chat template travel with it
    assert (wide_policy / "tokenizer.json").read_bytes() == (DEAL_POLICY_DIR / "tokenizer.json").read_bytes()


def test_widening_with_the_wide_heads_scale_would_change_the_function(wide_policy: Path, tmp_path: Path) -> None:
    """The gap the tolerance guards against is real: the wide heads' own scale, 1/sqrt(32), moves the logits."""
    broken = tmp_path / "wide-scale"
    broken.mkdir()
    for item in wide_policy.iterdir():
        if item.is_file():
            (broken / item.name).write_bytes(item.read_bytes())
    config = json.loads((wide_policy / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"attention_multiplier": 32**-0.5}))
    assert max_logit_gap(DEAL_POLICY_DIR, broken, [list(range(40))]) > 100 * LOGIT_TOLERANCE


def _adam_steps(folder: Path, batch: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits on ``batch`` after ``steps`` AdamW steps of next-token loss on it (the actor's optimiser, its
    defaults), every parameter the original also has trained; a bias only the copy has stays where it is."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not name.endswith("o_proj.bias"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    with torch.no_grad():
        return model(input_ids=batch).logits


def test_the_widened_policy_trains_as_the_original_does(wide_policy: Path) -> None:
    """Adam moves every weight by about the learning rate whatever its scale, so a copy whose weights are rescaled
    (a Llama copy's queries times sqrt(2)) learns at another rate; the Granite copy's weights are the original's
    own values, and the same steps keep the same function."""
    batch = torch.randint(0, 1132, (4, 64), generator=torch.Generator().manual_seed(1))
    original = _adam_steps(DEAL_POLICY_DIR, batch, steps=5)
    widened = _adam_steps(wide_policy, batch, steps=5)
    assert float((original - widened).abs().max()) < 100 * LOGIT_TOLERANCE


def test_widening_refuses_what_vllm_cpu_cannot_serve(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head sizes"):
        widen_heads(DEAL_POLICY_DIR, tmp_path / "w48", head_dim=48)


# ----- versions, host, settings


def _installed(**versions: str | None):
    table = {"vllm-cpu": "0.24.0", "torch": "2.11.0+cu130", "verl": "0.9.1", "vllm": None, **versions}
    return lambda name: table[name]


def test_versions_as_built_pass() -> None:
    assert vllm_cpu.check_versions(_installed()) == {"vllm-cpu": "0.24.0", "torch": "2.11.0+cu130", "verl": "0.9.1"}


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        ({"torch": "2.13.0+cpu"}, "torch 2.13.0+cpu is installed, 2.11.0 is needed"),
        ({"vllm-cpu": "0.25.0"}, "vllm-cpu 0.25.0 is installed, 0.24.0 is needed"),
        ({"vllm-cpu": None}, "vllm-cpu is not installed"),
        ({"vllm": "0.24.0"}, "the package vllm 0.24.0 (vLLM's CUDA build) is installed"),
        ({"verl": "0.9.2"}, "verl 0.9.2 is installed, 0.9.1 is needed"),
    ],
)
def test_a_drift_stops_with_the_versions_named(versions: dict[str, str | None], message: str) -> None:
    with pytest.raises(vllm_cpu.VllmCpuSetupError) as raised:
        vllm_cpu.check_versions(_installed(**versions))
    assert message in str(raised.value)
    assert "scripts/setup_vllm.sh" in str(raised.value)


def test_refuses_a_cuda_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(vllm_cpu.VllmCpuSetupError, match="this host has CUDA"):
        vllm_cpu.refuse_on_cuda_host()


def test_importing_without_the_cpu_platform_installs_nothing() -> None:
    if vllm_cpu.cpu_platform_selected():
        pytest.skip("this test process runs with VERL_PLATFORM=cpu")
    assert not any(isinstance(f, vllm_cpu._VllmAliasFinder) for f in sys.meta_path)


def test_settings_compose_with_verls_config() -> None:
    """Every override names a key verl's trainer config has (or adds one with +), with the CPU values."""
    import verl
    from hydra import compose, initialize_config_dir

    overrides = vllm_cpu.vllm_cpu_overrides(max_model_len=1024)
    assert "actor_rollout_ref.rollout.name=vllm" in overrides
    assert not any("hfcpu" in item for item in overrides)
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.enable_sleep_mode, rollout.free_cache_engine, rollout.enforce_eager) == (False, False, True)
    assert rollout.engine_kwargs.vllm.kv_cache_memory_bytes == vllm_cpu.KV_CACHE_BYTES
    env = vllm_cpu.vllm_cpu_env()
    assert env["VERL_PLATFORM"] == "cpu"
    assert env["VERL_USE_EXTERNAL_MODULES"].split(",") == [
        "nemo_gym_browser.local.cpu_backend.plugin",
        vllm_cpu.PLUGIN_MODULE,
    ]


def test_only_recent_unheld_segments_are_removed(tmp_path: Path) -> None:
    old = tmp_path / "psm_old"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    since = time.time() - 1
    (tmp_path / "psm_recent").write_bytes(b"x")
    (tmp_path / "ray_segment").write_bytes(b"x")  # not a multiprocessing segment name
    assert vllm_cpu.remove_orphaned_shm(since, tmp_path) == ["psm_recent"]
    assert old.exists() and (tmp_path / "ray_segment").exists()


def test_a_segment_a_live_process_holds_is_kept() -> None:
    held = Path("/dev/shm") / f"psm_vllmcputest{os.getpid()}"
    held.write_bytes(b"x")
    try:
        with open(held, "rb"):
            assert held.name in vllm_cpu._shm_in_use()
            assert held not in vllm_cpu.orphaned_shm(time.time() - 60)
    finally:
        held.unlink()


# ----- verl's vLLM rollout server on vLLM's CPU build


@pytest.mark.vllm_cpu
@needs_vllm_venv
def test_vllm_rollout_serves_the_actor_and_weight_syncs_take_effect_or_raise(wide_policy: Path, tmp_path: Path):
    report = tmp_path / "check.json"
    shm_before = set(os.listdir("/dev/shm"))
    result = subprocess.run(
        [str(VLLM_PYTHON), "-m", "nemo_gym_browser.local.vllm_cpu.check", "--model", str(wide_policy), "--json",
         str(report), "--sync-timeout", "60"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    tail = (result.stdout + result.stderr)[-4000:]
    assert report.exists(), tail
    stages = {stage["name"].split(":")[0]: stage for stage in json.loads(report.read_text())["stages"]}
    assert list(stages) == ["server up", "sync 1", "sync 2", "sync 3", "sync 4"], tail
    tolerance = json.loads(report.read_text())["tolerance"]
    assert stages["sync 1"]["figures"]["fixed-token gap"] < tolerance
    assert stages["sync 1"]["figures"]["sampled gap"] < tolerance
    assert stages["sync 1"]["figures"]["dummy-weight gap"] > tolerance  # the dummy weights were really replaced
    assert stages["sync 2"]["figures"]["gap before sync"] > tolerance > stages["sync 2"]["figures"]["gap after sync"]
    assert stages["sync 3"]["figures"]["gap"] > tolerance  # a sync that changed nothing fails the check
    assert stages["sync 4"]["figures"]["raised"] == "WeightSyncError", tail
    assert stages["sync 4"]["figures"]["s to raise"] < 60
    assert stages["sync 4"]["figures"]["gap after resync"] < tolerance
    assert result.returncode == 0, tail
    assert not {name for name in set(os.listdir("/dev/shm")) - shm_before if name.startswith("psm_")}


@pytest.fixture(scope="module")
def loop_report(wide_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The cancel and tools stages of ``loop_check``, on one vLLM server (a start costs about a minute here)."""
    return _loop_check(wide_policy, tmp_path_factory.mktemp("loop_check"), "cancel", "tools")


def _loop_check(wide_policy: Path, tmp_path: Path, *stages: str) -> tuple[dict, str]:
    """``python -m nemo_gym_browser.local.vllm_cpu.loop_check`` with .venv-vllm's interpreter: its report and the
    tail of its output; no /dev/shm segment of vLLM's left behind."""
    report = tmp_path / "loop_check.json"
    shm_before = set(os.listdir("/dev/shm"))
    result = subprocess.run(
        [str(VLLM_PYTHON), "-m", "nemo_gym_browser.local.vllm_cpu.loop_check", "--model", str(wide_policy),
         "--stages", *stages, "--json", str(report)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    tail = (result.stdout + result.stderr)[-4000:]
    assert report.exists(), tail
    assert not {name for name in set(os.listdir("/dev/shm")) - shm_before if name.startswith("psm_")}
    data = json.loads(report.read_text())
    data["returncode"] = result.returncode
    return data, tail


@pytest.mark.vllm_cpu
@needs_vllm_venv
def test_a_generation_cut_by_generate_within_stops_decoding_on_the_vllm_server(loop_report: tuple[dict, str]):
    """verl's LLMServerClient on the vllm path passes rollout_cancel's check; a request cut by a plain wait_for goes
    on decoding on the server, the same request cut by generate_within leaves vLLM's engine at once."""
    report, tail = loop_report
    stages = {stage["name"].split(":")[0]: stage["figures"] for stage in report["stages"]}
    assert list(stages) == ["server up", "client", "cancel", "tools"], tail
    assert stages["client"]["client"] == "verl.workers.rollout.llm_server.LLMServerClient"
    assert stages["client"]["tracked"] is True
    cancel = stages["cancel"]
    assert cancel["control generated before cut"] > 0 and cancel["cut generated before cut"] > 0, tail
    assert cancel["control generated after cut"] > 100, tail  # decoded for nobody
    assert cancel["cut generated after cut"] == 0, tail
    assert cancel["cut left engine after s"] is not None and cancel["cut left engine after s"] <= 2.0, tail
    assert report["details"]["cancel"]["cut"]["counter growth after leaving"] == 0
    assert report["returncode"] == 0, tail


@pytest.mark.vllm_cpu
@needs_vllm_venv
def test_the_recipes_hermes_parser_reads_the_tool_calls_vllm_generates(loop_report: tuple[dict, str]):
    """Deal-task episodes through BrowserToolAgentLoop with verl's client in front of vLLM: every turn vLLM generated
    parses into the same browser calls as a plain JSON reading of its text; greedy tokens equal the HF argmax."""
    report, tail = loop_report
    stages = {stage["name"].split(":")[0]: stage["figures"] for stage in report["stages"]}
    assert list(stages) == ["server up", "client", "cancel", "tools"], tail
    tools = stages["tools"]
    assert tools["turns"] >= tools["episodes"] == 32, tail
    assert tools["parser agrees"] == tools["turns"], report["details"]["tools"]["disagreements"]
    assert tools["turns with calls"] >= 0.9 * tools["turns"], tail
    assert tools["browser calls"] >= tools["turns with calls"]
    assert tools["episodes answered"] == tools["episodes"]
    assert tools["greedy tokens = HF argmax"] == tools["greedy tokens"] > 0
    assert tools["greedy call"].startswith('browser {"action": ')
    example = report["details"]["tools"]["examples"][0]
    assert "<tool_call>" in example["text"] and example["calls"][0][0] == "browser"
    assert report["returncode"] == 0, tail


# ----- main_ppo with --engine vllm (local/training_run.py, local/run_spec.py)


def _spec(tmp_path: Path, **changes):
    from nemo_gym_browser.local import run_spec as rs

    return rs.RunSpec(
        model_path=tmp_path / "model",
        train_file=tmp_path / "train.parquet",
        val_file=tmp_path / "val.parquet",
        server_urls=("http://127.0.0.1:1",),
        output_dir=tmp_path / "run",
        **changes,
    )


def test_the_vllm_engine_runs_verls_vllm_rollout_on_the_cpu_platform(tmp_path: Path, monkeypatch) -> None:
    from nemo_gym_browser.local import run_spec as rs

    spec = _spec(tmp_path, rollout_name=rs.VLLM_CPU_ENGINE)
    overrides = rs.hydra_overrides(spec)
    assert "actor_rollout_ref.rollout.name=vllm" in overrides
    assert "trainer.device=cpu" in overrides
    assert not any("hfcpu" in item for item in overrides)
    tokens = spec.max_prompt_length + spec.max_response_length
    assert f"actor_rollout_ref.rollout.max_model_len={tokens}" in overrides
    assert "reward.num_workers=1" in overrides  # verl's 8 would each hold ~0.5 GB for nothing
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni" in overrides
    env = rs.process_environment(spec, base={})
    assert env["VERL_PLATFORM"] == "cpu" and vllm_cpu.PLUGIN_MODULE in env["VERL_USE_EXTERNAL_MODULES"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else vLLM's CPU platform turns "uni" back into "mp"
    monkeypatch.setenv(rs.VLLM_VENV_ENV, str(tmp_path / "no-venv"))
    with pytest.raises(FileNotFoundError, match=r"setup_vllm\.sh"):
        rs.main_ppo_python(spec)
    assert rs.main_ppo_python(_spec(tmp_path)) == sys.executable  # hfcpu runs in this venv


def test_the_per_step_sync_check() -> None:
    from nemo_gym_browser.local import training_run as tr

    good = {1: {tr.SYNC_CHECK_KEY: 9.5e-7}, 2: {tr.SYNC_CHECK_KEY: 2e-6}}
    assert tr.sync_check(good, 2) == ""
    stale = {1: {tr.SYNC_CHECK_KEY: 9.5e-7}, 2: {tr.SYNC_CHECK_KEY: 0.4}}
    assert "disagree" in tr.sync_check(stale, 2) and "{2: 0.4}" in tr.sync_check(stale, 2)
    assert "logged no" in tr.sync_check({1: {}}, 1)
    assert "disagree" in tr.sync_check({1: {tr.SYNC_CHECK_KEY: float("nan")}}, 1)


def test_the_policy_is_served_widened_only_when_vllm_cpu_needs_it(wide_policy: Path, tmp_path: Path) -> None:
    from nemo_gym_browser.local import training_run as tr

    widened = tr.vllm_servable(DEAL_POLICY_DIR, tmp_path)
    assert widened == tmp_path / "deal_policy-head32"
    assert json.loads((widened / "config.json").read_text())["head_dim"] == 32
    assert tr.vllm_servable(wide_policy, tmp_path) == wide_policy


def test_a_run_on_the_widened_policy_builds_its_tokens_as_the_original_would(wide_policy: Path) -> None:
    """The copy is a Granite with the original's Qwen2 chat template: its runs name the template's family for
    verl's token builder (on the copy, verl's generic builder dropped the newline after each <|im_end|>)."""
    from nemo_gym_browser.local import run_spec as rs

    def overrides(model: Path) -> list[str]:
        spec = rs.RunSpec(model_path=model, train_file=Path("t.jsonl"), val_file=Path("v.jsonl"),
                          server_urls=("http://127.0.0.1:1",), output_dir=Path("/tmp/unused"))  # fmt: skip
        return [o for o in rs.hydra_overrides(spec) if "token_builder_model_type" in o]

    assert overrides(wide_policy) == ["++nemo_gym_browser.token_builder_model_type=qwen2"]
    assert overrides(DEAL_POLICY_DIR) == []


@pytest.mark.vllm_cpu
@needs_vllm_venv
def test_main_ppo_trains_two_steps_with_verls_vllm_rollout_on_cpu(tmp_path: Path) -> None:
    """verl's main_ppo, V1 trainer, hybrid vLLM replica on CPU, BrowserToolAgentLoop on the deal tasks against the
    real nemo-gym server with Chromium, 30 % of browser calls losing their session; every step's rollout
    probabilities equal the actor's (the per-sync check)."""
    shm_before = set(os.listdir("/dev/shm"))
    result = subprocess.run(
        [str(VLLM_PYTHON), "-m", "nemo_gym_browser.local.training_run", "--workdir", str(tmp_path), "--suite",
         "deal", "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--engine", "vllm",
         "--environment", "real", "--fault-rate", "0.3", "--fault-at", "browser-call", "--fault-kind",
         "lose_session", "--timeout", "1500"],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, tail
    assert "every step's rollout probabilities equal the actor's" in result.stdout, tail
    assert "sessions left open: 0" in result.stdout, tail
    from nemo_gym_browser.local.main_ppo_process import read_step_metrics

    steps = read_step_metrics(tmp_path / "run" / "metrics.jsonl")
    assert sorted(steps) == [1, 2]
    assert all(steps[step]["training/rollout_probs_diff_max"] < 1e-3 for step in (1, 2))
    assert not {name for name in set(os.listdir("/dev/shm")) - shm_before if name.startswith("psm_")}
