"""The environment client tests' settings (short timeouts and backoffs) and a client of the fake server."""

from __future__ import annotations

import pytest

from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.settings import EnvironmentConfig


def config(*urls: str, **overrides) -> EnvironmentConfig:
    """Client settings for ``urls`` with timeouts of a few seconds and near-instant retries, unless overridden."""
    values = dict(call_timeout_s=2.0, seed_timeout_s=2.0, verify_timeout_s=2.0, close_timeout_s=2.0)
    values.update(retry_backoff_s=0.01, server_cooldown_s=0.2)
    values.update(overrides)
    return EnvironmentConfig(server_urls=urls, **values)


@pytest.fixture
async def client(server):
    """A client of the ``server`` fixture (conftest's in-process environment server), closed after the test."""
    async with EnvironmentClient(config(server.url)) as env:
        yield env
