"""Shared test set-up: the integration fixtures (real server, local site), and a private loopback Ray with
TransferQueue for the tests that run verl's V1 trainer code."""

from __future__ import annotations

import pytest

pytest_plugins = ["environment_fixtures", "integration_fixtures", "judge_fixtures", "slurm_fixtures"]


@pytest.fixture(scope="module")
def tq():
    """A private local Ray instance with TransferQueue on it, kept on 127.0.0.1; one per test module."""
    import ray
    import transfer_queue
    from omegaconf import OmegaConf

    from nemo_gym_browser.testing.private_ray import private_ray

    with private_ray():
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        try:
            yield transfer_queue
        finally:
            transfer_queue.close()


# ----- the agent-loop tests' shared parts: verl's composed config, the recipe's tools, a tokenizer, a fake server


@pytest.fixture(scope="module")
def tokenizer():
    from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer

    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def trainer_config():
    from nemo_gym_browser.local.in_process_loop import compose_trainer_config

    return compose_trainer_config()


@pytest.fixture(scope="module")
def stepwise_trainer_config():
    """verl's config with a turn limit, as the recipe's always has: step-wise mode refuses to run without one."""
    from nemo_gym_browser.local.in_process_loop import compose_trainer_config

    return compose_trainer_config(overrides=["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=40"])


@pytest.fixture(scope="module")
def tools():
    from nemo_gym_browser.local.in_process_loop import load_tools

    return load_tools()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from nemo_gym_browser.local.chat_tokenizer import save_tokenizer_and_config

    return save_tokenizer_and_config(tmp_path_factory.mktemp("model"))


@pytest.fixture
async def server():
    """A in-process environment server; the loop's shared environment clients are closed after it."""
    from nemo_gym_browser.browser_agent_loop import close_shared_clients
    from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer

    async with InProcessEnvironmentServer() as fake:
        yield fake
    await close_shared_clients()
