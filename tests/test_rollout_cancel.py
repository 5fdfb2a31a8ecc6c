"""Tracking rollout-server requests only on a client that still looks like verl 0.9.1's ``LLMServerClient``."""

from __future__ import annotations

from typing import Any

import pytest
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

from nemo_gym_browser.agent_attempt.rollout_cancel import (
    RolloutCancelUnsupported,
    check_acquire_server,
    track_rollout_requests,
)


def bare(cls: type) -> Any:
    """An instance without running verl's constructor (which needs a load balancer); only methods are read."""
    return cls.__new__(cls)


@pytest.mark.parametrize("cls", [LLMServerClient, FullyAsyncLLMServerClient])
def test_verls_own_clients_pass_the_check_and_are_tracked_once(cls):
    client = bare(cls)
    check_acquire_server(client)

    assert track_rollout_requests(client) is True
    wrapped = client._acquire_server
    assert track_rollout_requests(client) is True
    assert client._acquire_server is wrapped  # not wrapped twice


def test_a_client_without_acquire_server_is_not_tracked():
    class Scripted:
        async def generate(self, request_id: str, **kwargs: Any) -> None:
            return None

    assert track_rollout_requests(Scripted()) is False


def test_an_acquire_server_whose_signature_changed_is_refused_naming_what_changed():
    class Changed(LLMServerClient):
        async def _acquire_server(self, request_id: str) -> tuple[str, Any]:  # no **extra any more
            raise AssertionError("never called")

    client = bare(Changed)
    with pytest.raises(RolloutCancelUnsupported, match=r"no longer takes \*\*extra") as raised:
        track_rollout_requests(client)
    assert "verl 0.9.1" in str(raised.value)
    assert "_nemo_gym_browser_tracks_requests" not in vars(client)  # left as it was


def test_a_client_whose_generate_never_acquires_a_server_is_refused():
    class Other:
        async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
            raise AssertionError("never called")

        async def generate(self, request_id: str, **kwargs: Any) -> None:
            return None

    with pytest.raises(RolloutCancelUnsupported, match="no generate of its classes calls"):
        check_acquire_server(Other())
