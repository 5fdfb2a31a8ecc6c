"""Fixtures for the judge tests: a fake OpenAI-compatible judge server and judges built against it, closed after."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from nemo_gym_browser.judge import BinaryJudge
from nemo_gym_browser.settings import JudgeConfig
from nemo_gym_browser.testing.fake_judge import FakeJudgeServer

# Short timeouts and backoffs, so a test of retries takes milliseconds.
FAST = {"timeout_s": 0.3, "connect_timeout_s": 0.3, "backoff_s": 0.005, "backoff_max_s": 0.05, "max_attempts": 3}

MakeJudge = Callable[..., BinaryJudge]


@pytest.fixture
async def fake() -> AsyncIterator[FakeJudgeServer]:
    async with FakeJudgeServer() as server:
        yield server


@pytest.fixture
async def make_judge(fake: FakeJudgeServer) -> AsyncIterator[MakeJudge]:
    """``make_judge(**settings)``: a judge of the fake server with :data:`FAST` timings unless overridden."""
    judges: list[BinaryJudge] = []

    def build(**overrides: object) -> BinaryJudge:
        values = {"base_url": fake.base_url, "model": fake.model, **FAST, **overrides}
        judge = BinaryJudge(JudgeConfig.from_mapping(values))
        judges.append(judge)
        return judge

    yield build
    for judge in judges:
        await judge.close()
