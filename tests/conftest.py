"""Shared test set-up: the integration fixtures (real server, local site), and a private loopback Ray with
TransferQueue for the tests that run verl's V1 trainer code."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["integration_fixtures", "slurm_fixtures"]

# Ray replaces a loopback node address with the machine's outward address unless its cluster mode is off.
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(scope="module")
def tq():
    """A private local Ray instance with TransferQueue on it, kept on 127.0.0.1; one per test module.

    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is read at import by Ray's own processes; the driver imported Ray
    already, hence its constant is set too.
    """
    import ray
    import ray._private.ray_constants as ray_constants
    import transfer_queue
    from omegaconf import OmegaConf

    assert not ray.is_initialized()
    saved = (os.environ.get(LOOPBACK_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER)
    os.environ[LOOPBACK_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            address="local",  # a new private instance, never a cluster someone else started on this machine
            num_cpus=2,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        yield transfer_queue
    finally:
        transfer_queue.close()
        ray.shutdown()
        if saved[0] is None:
            os.environ.pop(LOOPBACK_ONLY_ENV, None)
        else:
            os.environ[LOOPBACK_ONLY_ENV] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


# ----- the agent-loop tests' shared parts: verl's composed config, the recipe's tools, a tokenizer, a fake server


@pytest.fixture(scope="module")
def tokenizer():
    from nemo_gym_browser.testing.tokenizer import build_test_tokenizer

    return build_test_tokenizer()


@pytest.fixture(scope="module")
def trainer_config():
    from nemo_gym_browser.testing.agent_loop_harness import compose_trainer_config

    return compose_trainer_config()


@pytest.fixture(scope="module")
def tools():
    from nemo_gym_browser.testing.agent_loop_harness import load_tools

    return load_tools()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from nemo_gym_browser.testing.tokenizer import save_test_model

    return save_test_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
async def server():
    """A fake environment server; the loop's shared environment clients are closed after it."""
    from nemo_gym_browser.browser_agent_loop import close_shared_clients
    from nemo_gym_browser.testing.fake_environment import FakeEnvironmentServer

    async with FakeEnvironmentServer() as fake:
        yield fake
    await close_shared_clients()
