"""Chaos runs of the real agent loop: inject infrastructure faults and policy mistakes, then check who got blamed.

What a run does
    Rollouts of the recipe's real ``BrowserToolAgentLoop`` (one loop object per episode, built as verl builds
    them) run concurrently against one or more environment servers, driven by a scripted policy. Every rollout
    is given one *cause* for its first attempt:

    * an infrastructure fault aimed at that attempt's session: a 5xx, a call that hangs past its timeout, a
      dropped connection, a lost session (on ``browser_click``), a failed seed, a verify that cannot grade, a
      judge that stops answering (tasks without ``verifier_metadata``);
    * a policy outcome: a clean walk, a wrong answer, an element id not on the page, arguments the server rejects
      (422), a URL of its own that fails to load, a URL the guard refuses, no answer at all, running out of turns,
      running out of environment time (slow pages: the deadline does not count generation), a task the judge grades;
    * or, in the server-wide phases, whatever hits it: a server killed and restarted while the phase's sessions
      are open (every session open on it then is a victim), and a burst of 503s on every call a server gets for a
      while (every session that received one is a victim; the rest had no fault).

    Faults are aimed by session id: the loop names a rollout ``r<row index>-<hex>`` and the environment client
    names its sessions ``<rollout id>.<attempt>.<n>``, so a server-side observer knows the row and the attempt
    of every call (:func:`parse_session_id`; a run fails loudly if a session id does not parse). Only the first
    attempt is faulted, so a resample can recover. Causes are settled by what happened, not by the plan: a planned
    fault that never fired (the attempt ended first) leaves a policy outcome, and a first attempt that the real
    server failed by itself (a call cut off or answered 5xx with no fault of ours, seen by the proxy) is listed as
    the environment failing on its own.

What it reports (:class:`ChaosReport`)
    The confusion matrix of cause against what the rollout recorded for its first attempt (an infrastructure
    failure, with its ``env_failure_kind``, or a valid policy outcome), the sessions left open on the servers, the
    longest attempt (a session's first to last call as the server saw them) against the deadline plus one per-call
    timeout, and the share of rollout slots that still produced a valid sample.

Backends
    :class:`FakeBackend`: in-process fake servers, faults injected by the fake itself (scale, offline).
    :class:`ProxiedBackend`: any servers behind :class:`~nemo_gym_browser.testing.fault_proxy.FaultProxy` (the real
    NeMo Gym server; the fake too, to test the proxy path offline); killing a server stops its proxy, restarts the
    server behind it through a callback, and starts the proxy again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..browser_agent_loop import close_shared_clients
from ..judge import BinaryJudge, JudgeConfig
from . import fake_judge as fj
from . import scripted_policy as sp
from .agent_loop_harness import agent_loop_entry, compose_trainer_config, load_tools, make_row
from .benchmarking import LoopFactory
from .fake_environment import FakeEnvironmentServer
from .fault_proxy import FaultProxy
from .faults import HANG_LIMIT_S, Fault, Rule, SeenRequest
from .tokenizer import build_test_tokenizer

logger = logging.getLogger(__name__)

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
VERIFIER = {"url_contains": "about.html"}
ANSWER = "ALPHA-42"
DEAD_URL = "http://127.0.0.1:9/"  # a loopback port nothing listens on: the navigation fails, nothing leaves the host
REFUSED_URL = "http://169.254.169.254/latest/meta-data/"
JUDGE_MODEL = "fake-judge"

INFRA = "infrastructure"
POLICY = "policy"
NO_FAULT = "no fault (server-wide phase)"

_SESSION_ID = re.compile(r"^r(?P<index>\d+)-[0-9a-f]+\.(?P<attempt>\d+)\.\d+$")


def parse_session_id(session_id: str | None) -> tuple[int, int] | None:
    """``(row index, attempt)`` of a session the recipe opened, from its id; None for anything else."""
    match = _SESSION_ID.match(session_id or "")
    return (int(match["index"]), int(match["attempt"])) if match else None


# ----- causes --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cause:
    """One thing that happens to a rollout's first attempt."""

    name: str
    side: str  # INFRA or POLICY
    expected_kinds: frozenset[str] = frozenset()  # env_failure_kind values that are right for an INFRA cause
    endpoint: str | None = None  # where a targeted fault fires
    fault: str | None = None  # "status", "hang", "drop", "lose_session", "fail_seed"
    judged: bool = False  # the task has no verifier_metadata: the judge scores it


def _infra(name: str, endpoint: str | None, fault: str | None, *kinds: str, judged: bool = False) -> Cause:
    return Cause(name, INFRA, frozenset(kinds), endpoint, fault, judged)


TARGETED_FAULTS = (
    _infra("5xx answer", "browser_click", "status", "server_error"),
    _infra("call hangs past its timeout", "browser_click", "hang", "timeout"),
    _infra("connection dropped", "browser_click", "drop", "unreachable"),
    _infra("session lost", "browser_click", "lose_session", "session_lost"),
    _infra("seed fails", "seed_session", "fail_seed", "seed_failed"),
    _infra("verify cannot grade", "verify", "status", "verify_unavailable"),
    _infra("judge stops answering", None, None, "judge_unusable", judged=True),
)
# The judge gives no usable verdict on any of its retries: the trajectory is kept, flagged, and no new episode is
# spent on it (the one targeted cause whose rollout is meant to end invalid).
JUDGE_DOWN = TARGETED_FAULTS[-1]
# A hang that starts when less than one per-call timeout of environment time is left before the deadline (slow
# observes spend it first): still the server's fault.
HANG_NEAR_DEADLINE = _infra("call hangs near the deadline", "browser_click", "hang", "timeout")
EDGE_CASES = (HANG_NEAR_DEADLINE,)
POLICY_OUTCOMES = (
    Cause("clean walk", POLICY),
    Cause("wrong answer", POLICY),
    Cause("element id not on the page", POLICY),
    Cause("arguments the server rejects (422)", POLICY),
    Cause("own URL fails to load", POLICY),
    Cause("URL refused by the guard", POLICY),
    Cause("no answer", POLICY),
    Cause("out of turns", POLICY),
    # The deadline counts environment time: every observe of this row is slow (within its timeout).
    Cause("out of time (deadline)", POLICY, endpoint="browser_observe", fault="slow"),
    Cause("judged task", POLICY, judged=True),
)
SERVER_KILLED = _infra(
    "server killed and restarted", None, None, "session_lost", "unreachable", "server_error", "timeout", "seed_failed"
)
BURST_5XX = _infra(
    "5xx burst", None, None, "server_error", "seed_failed", "verify_unavailable", "session_lost", "unreachable"
)
NONE = Cause(NO_FAULT, POLICY)
# A first attempt that failed in the environment before (or without) any injected fault: a real server that was too
# slow or failed by itself (seen by the proxy as a call answered 5xx or cut off without a fault of ours).
UNINJECTED = _infra(
    "environment failed on its own (not injected)",
    None,
    None,
    *("seed_failed", "session_lost", "unreachable", "server_error", "timeout", "verify_unavailable"),
)
# The rollouts of the server-wide phases until the phase tells victims from the others (clean walks, slow turns).
KILL_PHASE = Cause("kill phase", POLICY)
BURST_PHASE = Cause("burst phase", POLICY)
ALL_CAUSES = (*TARGETED_FAULTS, *EDGE_CASES, SERVER_KILLED, BURST_5XX, UNINJECTED, *POLICY_OUTCOMES, NONE)


def _script(cause: Cause) -> sp.Script:
    """The policy's behaviour for a rollout of ``cause`` (infrastructure rows walk cleanly: their resample scores)."""
    walk = sp.walk_and_finish("About", f"The code is {ANSWER}")
    scripts: dict[str, sp.Script] = {
        "wrong answer": sp.steps(sp.observe(), sp.finish("I could not find it")),
        "element id not on the page": sp.steps(
            sp.observe(), sp.click_matching("No such link"), sp.click_matching("About"), sp.finish(ANSWER)
        ),
        "arguments the server rejects (422)": sp.steps(
            sp.observe(), sp.say(sp.native("click", elementId=1)), sp.click_matching("About"), sp.finish(ANSWER)
        ),
        "own URL fails to load": sp.steps(sp.navigate(DEAD_URL), sp.finish("the page did not load")),
        "URL refused by the guard": sp.steps(
            sp.navigate(REFUSED_URL), sp.observe(), sp.click_matching("About"), sp.finish(ANSWER)
        ),
        "no answer": sp.steps(then="I cannot do this task."),
        "out of turns": sp.repeat(sp.observe()),
        "out of time (deadline)": sp.repeat(sp.observe()),
    }
    return scripts.get(cause.name, walk)


def marker(cause: Cause, index: int) -> str:
    """The tag in a row's task text by which the scripted policy and the fake judge know the row."""
    return f"[chaos #{index}: {cause.name}]"


# ----- settings ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosSettings:
    """Timeouts and sizes of a chaos run. The defaults suit in-process fakes; the real server needs longer ones."""

    call_timeout_s: float = 1.0
    seed_timeout_s: float = 5.0
    verify_timeout_s: float = 2.0
    close_timeout_s: float = 2.0
    episode_deadline_s: float = 4.0
    max_attempts: int = 3
    resample_backoff_s: float = 0.2
    max_sessions_per_server: int = 64
    max_assistant_turns: int = 8
    think_time_s: float = 0.0  # every turn of every rollout
    phase_think_time_s: float = 0.3  # turns of the server-wide phases, so their sessions stay open a while
    judge_timeout_s: float = 1.0
    judge_max_attempts: int = 2
    burst_s: float = 0.5

    def environment(self, urls: Sequence[str]) -> dict[str, Any]:
        return {
            "server_urls": list(urls),
            "call_timeout_s": self.call_timeout_s,
            "seed_timeout_s": self.seed_timeout_s,
            "verify_timeout_s": self.verify_timeout_s,
            "close_timeout_s": self.close_timeout_s,
            "server_cooldown_s": 1.0,
            "max_sessions_per_server": self.max_sessions_per_server,
        }


# The real server drives Chromium on a shared 2-core machine: calls take seconds, not milliseconds.
REAL_SERVER_SETTINGS = ChaosSettings(
    call_timeout_s=8.0,
    seed_timeout_s=30.0,
    verify_timeout_s=15.0,
    close_timeout_s=10.0,
    episode_deadline_s=20.0,
    max_attempts=4,
    resample_backoff_s=3.0,  # 3 + 6 + 12 s: a resample outlives the ~15 s a killed server needs to come back
    max_sessions_per_server=8,
    phase_think_time_s=1.0,
    judge_timeout_s=2.0,
    burst_s=2.0,
)


# ----- backends ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """A call a server (or its proxy) saw, with the fault it got."""

    server: int
    session_id: str | None
    endpoint: str
    at: float  # when the server (or its proxy) received the call
    fault: str | None


Targeting = Callable[[int, str | None, str], str | None]  # (server, session id, endpoint) -> fault kind or None


class Backend:
    """What a chaos run needs from the servers. Subclasses: :class:`FakeBackend`, :class:`ProxiedBackend`."""

    urls: list[str]
    hits: list[Hit]

    def __init__(self) -> None:
        self.hits = []
        self.targeting: Targeting | None = None
        self.slow_s = 0.0  # how long a "slow" call waits before it is handled (below the per-call timeout)
        self.hang_s = HANG_LIMIT_S  # how long a "hang" holds its call: past any per-call timeout
        self._bursting: set[int] = set()

    def fault_for(self, server: int, session_id: str | None, endpoint: str) -> str | None:
        if server in self._bursting:
            return "burst"
        return self.targeting(server, session_id, endpoint) if self.targeting is not None else None

    def rule(self, server: int) -> Rule:
        """The one fault rule of ``server``: records every call it is asked about and fails those the run aims at."""

        def rule(request: SeenRequest) -> Fault | None:
            kind = self.fault_for(server, request.session_id, request.endpoint)
            self.hits.append(Hit(server, request.session_id, request.endpoint, request.received_at, kind))
            return None if kind is None else self._fault_of(kind)

        return rule

    def _fault_of(self, kind: str) -> Fault:
        """The fault a planned ``kind`` is: the same value whether a fake server or a proxy carries it out."""
        return {
            "status": Fault.status(503),
            "burst": Fault.status(503),
            "hang": Fault.hang(self.hang_s),
            "slow": Fault.hang(self.slow_s),
            "drop": Fault.drop_connection(),
            "lose_session": Fault.lose_session(),
            "fail_seed": Fault.fail_seed(),
        }[kind]

    async def burst(self, server: int, seconds: float) -> None:
        """Every call to ``server`` answers 503 for ``seconds``."""
        self._bursting.add(server)
        try:
            await asyncio.sleep(seconds)
        finally:
            self._bursting.discard(server)

    async def kill_and_restart(self, server: int) -> None:
        raise NotImplementedError

    def open_session_ids(self, server: int) -> tuple[str, ...]:
        raise NotImplementedError

    async def sessions_left_open(self) -> tuple[dict[str, int], int]:
        """What the servers still hold after the run: counts by what was measured, and the number of sessions."""
        raise NotImplementedError

    def uninjected_failures(self) -> set[str]:
        """Sessions that got a 5xx or lost a call (other than a close) without an injected fault, where the backend
        can tell (the proxy can; the fakes fail only when told to)."""
        return set()

    def seed_answered_at(self) -> dict[str, float]:
        """When each session's seed was answered (where the backend can tell; else when it was received)."""
        return {h.session_id: h.at for h in self.hits if h.endpoint == "seed_session" and h.session_id}

    def attempt_spans(self) -> dict[str, float]:
        """Per session: from its seed's answer to the first verify or close, i.e. the episode the deadline bounds.

        A session never verified nor closed (a leak) is measured to its last call.
        """
        start = self.seed_answered_at()
        end: dict[str, float] = {}
        last: dict[str, float] = {}
        for hit in self.hits:
            if hit.session_id in start:
                last[hit.session_id] = hit.at
                if hit.endpoint in ("verify", "close_session"):
                    end.setdefault(hit.session_id, hit.at)
        return {s: max(0.0, end.get(s, last.get(s, t)) - t) for s, t in start.items()}


class FakeBackend(Backend):
    """``count`` in-process fake servers with ``latency_s`` per call."""

    def __init__(self, count: int, *, latency_s: float = 0.0, hang_s: float = 30.0, downtime_s: float = 0.3) -> None:
        super().__init__()
        self.servers = [FakeEnvironmentServer(latency_s=latency_s) for _ in range(count)]
        self.hang_s = hang_s
        self.downtime_s = downtime_s

    async def __aenter__(self) -> FakeBackend:
        for index, server in enumerate(self.servers):
            await server.start()
            server.set_rule(self.rule(index))
        self.urls = [server.url for server in self.servers]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for server in self.servers:
            await server.stop()

    async def kill_and_restart(self, server: int) -> None:
        fake = self.servers[server]
        await fake.stop(lose_state=True)  # the process dies with its browsers
        await asyncio.sleep(self.downtime_s)
        await fake.start()

    def open_session_ids(self, server: int) -> tuple[str, ...]:
        return self.servers[server].open_session_ids

    async def sessions_left_open(self) -> tuple[dict[str, int], int]:
        counts = {
            "open sessions": sum(s.open_sessions for s in self.servers),
            "orphaned browsers": sum(s.orphaned_browsers for s in self.servers),
        }
        return counts, sum(counts.values())


class ProxiedBackend(Backend):
    """Servers behind fault proxies. ``restart(i)`` restarts server ``i`` behind its proxy (killing its browsers);
    ``leftovers()`` reports what the servers still hold (every value should be 0)."""

    def __init__(
        self,
        upstreams: Sequence[str],
        *,
        restart: Callable[[int], Awaitable[None]],
        leftovers: Callable[[], Awaitable[dict[str, int]]],
        upstream_timeout_s: float = 300.0,
    ) -> None:
        super().__init__()
        self.proxies = [FaultProxy(url, upstream_timeout_s=upstream_timeout_s) for url in upstreams]
        self._restart = restart
        self._leftovers = leftovers

    async def __aenter__(self) -> ProxiedBackend:
        for index, proxy in enumerate(self.proxies):
            await proxy.start()
            proxy.set_rule(self.rule(index))
        self.urls = [proxy.url for proxy in self.proxies]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for proxy in self.proxies:
            await proxy.close()

    async def kill_and_restart(self, server: int) -> None:
        proxy = self.proxies[server]
        await proxy.stop()  # connections cut, port refuses: what clients see of a dead server
        await self._restart(server)
        proxy.forget_sessions()  # the restarted server holds none of them
        await proxy.start()

    def open_session_ids(self, server: int) -> tuple[str, ...]:
        return self.proxies[server].open_session_ids

    async def sessions_left_open(self) -> tuple[dict[str, int], int]:
        counts = {"open sessions (seen through the proxies)": sum(len(p.open_session_ids) for p in self.proxies)}
        counts.update(await self._leftovers())
        return counts, max(counts.values())  # several measures of the same browsers

    def uninjected_failures(self) -> set[str]:
        return {
            entry.request.session_id
            for proxy in self.proxies
            for entry in proxy.log
            if entry.fault is None
            and entry.request.session_id
            and entry.request.endpoint != "close_session"
            and (entry.status is None or entry.status >= 500)
        }

    def seed_answered_at(self) -> dict[str, float]:
        return {
            entry.request.session_id: entry.finished_at
            for proxy in self.proxies
            for entry in proxy.log
            if entry.request.endpoint == "seed_session" and entry.request.session_id and entry.status == 200
        }


@contextlib.asynccontextmanager
async def local_environment_backend(**environment_kwargs: Any) -> AsyncIterator[ProxiedBackend]:
    """The real NeMo Gym 0.7.0 server (``launch_environment.LocalEnvironment``) behind a fault proxy.

    Killing it stops the proxy, stops the server and its Chromium (every browser dies), starts a new one on the
    same port and reopens the proxy. What is left open afterwards is read from the server's browser state.
    """
    from ..launch_environment import LocalEnvironment

    current = [await asyncio.to_thread(LocalEnvironment(**environment_kwargs).start)]

    async def restart(server: int) -> None:
        port = current[0].port
        await asyncio.to_thread(current[0].stop)
        current[0] = await asyncio.to_thread(LocalEnvironment(**{**environment_kwargs, "port": port}).start)

    async def leftovers() -> dict[str, int]:
        state = await asyncio.to_thread(current[0].wait_for_idle, 20.0)
        return {
            "browser contexts": state.contexts or 0,
            "pages": state.pages or 0,
            "playwright drivers": state.drivers,
            "browsers": state.browsers,
        }

    try:
        async with ProxiedBackend([current[0].url], restart=restart, leftovers=leftovers) as backend:
            yield backend
    finally:
        await asyncio.to_thread(current[0].stop)


# ----- the run -------------------------------------------------------------------------------------------------


@dataclass
class RolloutRecord:
    index: int
    cause: Cause
    phase: str
    output: Any = None
    error: str | None = None

    @property
    def flags(self) -> Mapping[str, Any]:
        return getattr(self.output, "extra_fields", {}) or {}

    @property
    def first_attempt(self) -> tuple[str, str | None]:
        """``(INFRA, kind)`` if the first attempt failed in the infrastructure, else ``(POLICY, None)``."""
        kinds = self.flags.get("env_failed_attempt_kinds") or []
        return (INFRA, kinds[0]) if kinds else (POLICY, None)

    @property
    def valid(self) -> bool:
        return self.output is not None and not self.flags.get("env_invalid", True)


@dataclass
class ChaosReport:
    target: str
    settings: ChaosSettings
    records: list[RolloutRecord]
    left_open: dict[str, int]  # by what was measured
    left_open_total: int  # sessions still holding a browser
    closes_refused: int  # sessions none of whose closes got through (each answered by an injected fault)
    attempt_seconds: dict[str, float]  # session id -> seed answered to verify/close received
    loop_lag_s: float  # the longest the run's event loop was late to wake a sleeper (its own overload)
    wall_s: float
    unparsed_sessions: list[str] = field(default_factory=list)

    @property
    def matrix(self) -> dict[str, collections.Counter[str]]:
        table: dict[str, collections.Counter[str]] = {}
        for record in self.records:
            side, _ = record.first_attempt
            table.setdefault(record.cause.name, collections.Counter())[side] += 1
        return table

    @property
    def misclassified(self) -> list[RolloutRecord]:
        """Rollouts whose first attempt was blamed on the wrong side, or failed with an unexpected kind."""
        wrong = []
        for record in self.records:
            side, kind = record.first_attempt
            if record.error is not None or side != record.cause.side:
                wrong.append(record)
            elif side == INFRA and kind not in record.cause.expected_kinds:
                wrong.append(record)
        return wrong

    @property
    def policy_rows_wrong(self) -> list[RolloutRecord]:
        """Policy outcomes that did not end as their script intends (deadline rows must hit the deadline, ...)."""
        wrong = []
        for record in self.records:
            if record.cause.side != POLICY or record.output is None:
                continue
            flags = record.flags
            if record.cause.name == "out of time (deadline)" and not flags.get("deadline_hit"):
                wrong.append(record)
            if record.cause.name == "judged task" and flags.get("reward_source") != "judge":
                wrong.append(record)
        return wrong

    @property
    def longest_attempt(self) -> tuple[str | None, float]:
        if not self.attempt_seconds:
            return None, 0.0
        session = max(self.attempt_seconds, key=self.attempt_seconds.__getitem__)
        return session, self.attempt_seconds[session]

    @property
    def attempt_bound_s(self) -> float:
        return self.settings.episode_deadline_s + self.settings.call_timeout_s

    @property
    def valid_expected(self) -> list[RolloutRecord]:
        """Rollout slots meant to end valid: all but those whose judge stayed down (kept flagged by design)."""
        return [r for r in self.records if r.cause.name != JUDGE_DOWN.name]

    @property
    def valid_fraction(self) -> float:
        expected = self.valid_expected
        return sum(r.valid for r in expected) / len(expected) if expected else 0.0

    def targets(self) -> list[tuple[str, bool]]:
        infra = [r for r in self.records if r.cause.side == INFRA]
        policy = [r for r in self.records if r.cause.side == POLICY]
        infra_right = [r for r in infra if r.first_attempt[0] == INFRA]
        kinds_right = [r for r in infra_right if r.first_attempt[1] in r.cause.expected_kinds]
        policy_blamed = [r for r in policy if r.first_attempt[0] == INFRA]
        scripted = len(policy) - len(self.policy_rows_wrong)
        crashed = sum(r.error is not None for r in self.records)
        _, longest = self.longest_attempt
        left = self.left_open_total
        bound = (
            f"longest attempt {longest:.2f} s vs deadline {self.settings.episode_deadline_s:g} s + one per-call "
            f"timeout {self.settings.call_timeout_s:g} s = {self.attempt_bound_s:g} s (+ event-loop lag "
            f"{self.loop_lag_s:.2f} s: every timer of this process fired that late at worst)"
        )
        return [
            (f"infrastructure faults classified infrastructure: {len(infra_right)}/{len(infra)}",
             len(infra_right) == len(infra)),
            (f"failure kinds as expected for them: {len(kinds_right)}/{len(infra)}", len(kinds_right) == len(infra)),
            (f"policy outcomes classified infrastructure: {len(policy_blamed)}/{len(policy)}", not policy_blamed),
            (f"policy outcomes ended as scripted: {scripted}/{len(policy)}", scripted == len(policy)),
            (f"sessions left open on the servers: {left} ({self._left_text()})", left == 0),
            (bound, longest <= self.attempt_bound_s + self.loop_lag_s),
            (f"rollouts that crashed instead of returning a sample: {crashed}", crashed == 0),
            (f"session ids not attributable to a rollout: {len(self.unparsed_sessions)}", not self.unparsed_sessions),
        ]  # fmt: skip

    def _left_text(self) -> str:
        measures = ", ".join(f"{name} {count}" for name, count in self.left_open.items())
        return f"{measures}; sessions whose every close got a 5xx: {self.closes_refused}"

    def format(self) -> str:
        lines = [f"-- {self.target}: {len(self.records)} rollouts in {self.wall_s:.1f} s"]
        lines.append(
            f"{'injected cause (first attempt)':<58} | {'infra':>6} | {'policy':>6} | recorded env_failure_kind"
        )
        lines.append("-" * 100)
        kinds: dict[str, collections.Counter[str]] = {}
        for record in self.records:
            side, kind = record.first_attempt
            if side == INFRA:
                kinds.setdefault(record.cause.name, collections.Counter())[kind or "?"] += 1
        matrix = self.matrix
        sides = {r.cause.name: r.cause.side for r in self.records}
        known = [c.name for c in ALL_CAUSES]
        for name in [*known, *sorted(set(matrix) - set(known))]:
            if name not in matrix:
                continue
            row = matrix[name]
            kind_text = ", ".join(f"{k} {n}" for k, n in sorted(kinds.get(name, {}).items()))
            label = f"{name} ({'infra' if sides[name] == INFRA else 'policy'})"
            lines.append(f"{label:<58} | {row[INFRA]:>6} | {row[POLICY]:>6} | {kind_text}")
        resampled = [r for r in self.records if (r.flags.get("env_attempts") or 1) > 1]
        again = sum(len(r.flags.get("env_failed_attempt_kinds") or []) > 1 for r in self.records)
        lines.append(
            f"resampled rollouts: {len(resampled)}, of which a later attempt failed again: {again}; "
            f"valid samples: {sum(r.valid for r in self.valid_expected)}/{len(self.valid_expected)} = "
            f"{self.valid_fraction:.1%} (judge-down rows, kept flagged, not counted)"
        )
        rollout_walls = [float(r.flags.get("env_episode_wall_s") or 0.0) for r in self.records]
        session, longest = self.longest_attempt
        lines.append(
            f"longest attempt: {longest:.2f} s (session {session}); longest rollout, all attempts and backoffs: "
            f"{max(rollout_walls, default=0.0):.2f} s"
        )
        for record in self.misclassified[:10]:
            side, kind = record.first_attempt
            lines.append(
                f"  MISCLASSIFIED #{record.index} {record.cause.name}: recorded {side} {kind or ''} "
                f"{record.error or record.flags.get('env_failure_reason') or ''}"[:200]
            )
        for text, ok in self.targets():
            lines.append(f"{'ok  ' if ok else 'MISS'} {text}")
        return "\n".join(lines)


class ChaosRun:
    """Runs the phases of a chaos run against a backend and builds the :class:`ChaosReport`."""

    def __init__(self, backend: Backend, settings: ChaosSettings, *, judge: fj.FakeJudgeServer) -> None:
        self.backend = backend
        self.settings = settings
        self.judge = judge
        self.tokenizer = build_test_tokenizer()
        config = compose_trainer_config(
            overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={settings.max_assistant_turns}"]
        )
        judge_settings = {
            "base_url": judge.base_url,
            "model": JUDGE_MODEL,
            "timeout_s": settings.judge_timeout_s,
            "max_attempts": settings.judge_max_attempts,
            "backoff_s": 0.05,
            "cache_size": 0,
        }
        self.judge_config = JudgeConfig.from_mapping(judge_settings)
        entry = agent_loop_entry(
            environment=settings.environment(backend.urls),
            episode_deadline_s=settings.episode_deadline_s,
            max_attempts=settings.max_attempts,
            resample_backoff_s=settings.resample_backoff_s,
            url_policy={"allowlist": [DEAD_URL.rstrip("/")]},
            judge=judge_settings,
        )
        tools = [*load_tools(), *load_tools(native=True)]  # the single tool and NeMo Gym's five (for 422s)
        self.factory = LoopFactory(entry, tools, config, self.tokenizer)
        self.records: list[RolloutRecord] = []
        self._plan: dict[int, Cause] = {}
        self._indices = itertools.count()
        self._judge_calls: collections.Counter[str] = collections.Counter()
        self.loop_lag_s = 0.0
        judge.default = fj.Behaviour(respond=self._judge_behaviour)
        backend.targeting = self._targeting
        # The deadline counts environment time only, so the rows that must reach it spend it in slow observes:
        # HANG_NEAR_DEADLINE makes `near_deadline_observes` of them, then the click that hangs with half a per-call
        # timeout of environment time left; each stays below the per-call timeout.
        act_at = settings.episode_deadline_s - settings.call_timeout_s / 2
        self.near_deadline_observes = max(1, math.ceil(act_at / (0.8 * settings.call_timeout_s)))
        backend.slow_s = act_at / self.near_deadline_observes

    # --- who gets which fault ---

    def _targeting(self, server: int, session_id: str | None, endpoint: str) -> str | None:
        parsed = parse_session_id(session_id)
        if parsed is None or parsed[1] != 1:
            return None
        cause = self._plan.get(parsed[0])
        if cause is HANG_NEAR_DEADLINE and endpoint == "browser_observe":
            return "slow"
        if cause is None or cause.endpoint != endpoint:
            return None
        return cause.fault

    def _judge_behaviour(self, request: fj.RecordedRequest) -> fj.Behaviour:
        task = request.data_block("task") or ""
        down = next((m for m in re.findall(r"\[chaos #\d+: [^\]]+\]", task) if "judge stops answering" in m), None)
        if down is not None:
            self._judge_calls[down] += 1
            if self._judge_calls[down] <= self.settings.judge_max_attempts:  # every request of the first attempt
                return fj.hang()
        answer = request.data_block("final_answer") or ""
        return fj.verdict(ANSWER in answer)

    # --- rollouts ---

    def _row(self, index: int, cause: Cause) -> dict[str, Any]:
        task = f"Open the About page and report the secret code {marker(cause, index)}"
        return make_row(
            task=task,
            task_id=f"chaos-{index}",
            index=index,
            verifier_metadata=None if cause.judged else VERIFIER,
            reference_answer=ANSWER if cause.judged else None,
        )

    def _think(self, view: sp.PolicyView) -> float:
        task = view.task
        if f"{KILL_PHASE.name}]" in task or f"{BURST_PHASE.name}]" in task:
            return self.settings.phase_think_time_s
        return self.settings.think_time_s

    async def _rollout(self, index: int, cause: Cause, phase: str) -> RolloutRecord:
        record = RolloutRecord(index, cause, phase)
        script = _script(cause)
        if cause is HANG_NEAR_DEADLINE:
            observes = [sp.observe()] * self.near_deadline_observes
            script = sp.steps(*observes, sp.click_matching("About"), sp.finish(f"The code is {ANSWER}"))
        policy = sp.ScriptedPolicy(self.tokenizer, script, think_time_s=self._think)
        try:
            loop = self.factory.build(policy)
            record.output = await loop.run(SAMPLING, **self._row(index, cause))
        except Exception as exc:  # a crash is a finding, not a reason to stop the run
            logger.exception("chaos rollout #%d (%s) crashed", index, cause.name)
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    async def targeted_phase(self, causes: Sequence[Cause]) -> None:
        """Every cause in ``causes`` is one rollout; all run at once."""
        tasks = []
        for cause in causes:
            index = next(self._indices)
            self._plan[index] = cause
            tasks.append(self._rollout(index, cause, "targeted"))
        self.records += await asyncio.gather(*tasks)

    async def server_wide_phase(self, kind: str, rollouts: int, server: int) -> None:
        """``rollouts`` clean walks; once all have a session open, kill/restart ``server`` or burst 5xx on it."""
        indices = [next(self._indices) for _ in range(rollouts)]
        phase_cause = KILL_PHASE if kind == "kill" else BURST_PHASE
        tasks = [asyncio.create_task(self._rollout(i, phase_cause, kind)) for i in indices]
        wanted = set(indices)
        deadline = time.monotonic() + self.settings.seed_timeout_s * 2 + 10
        while time.monotonic() < deadline and not all(t.done() for t in tasks):
            seeded = {parse_session_id(h.session_id)[0] for h in self.backend.hits if _seeded_call(h)} & wanted
            if seeded == wanted:
                break
            await asyncio.sleep(0.02)
        victims: set[int] = set()
        if kind == "kill":
            victims = {p[0] for p in map(parse_session_id, self.backend.open_session_ids(server)) if p} & wanted
            await self.backend.kill_and_restart(server)
        else:
            first = len(self.backend.hits)
            await self.backend.burst(server, self.settings.burst_s)
            # A 503 on the close alone does not touch the sample (the verdict is in): not a victim.
            burst_hits = [h for h in self.backend.hits[first:] if h.fault == "burst" and h.endpoint != "close_session"]
            victims = {p[0] for p in (parse_session_id(h.session_id) for h in burst_hits) if p and p[1] == 1}
        records = await asyncio.gather(*tasks)
        for record in records:
            record.cause = (SERVER_KILLED if kind == "kill" else BURST_5XX) if record.index in victims else NONE
        self.records += records

    def _attribute(self) -> None:
        """Name the cause of every targeted-phase first attempt by what actually happened to it.

        A planned fault that never fired (the attempt ended before the faulted call, e.g. at its deadline) was not
        injected: the rollout is listed under its own policy row. A first attempt the environment failed by itself
        before any injected fault (a real server too slow for the per-call timeout) is listed as such.
        """
        fired, uninjected = set(), set()
        for hit in self.backend.hits:
            parsed = parse_session_id(hit.session_id)
            if hit.fault not in (None, "burst", "slow") and parsed is not None and parsed[1] == 1:
                fired.add(parsed[0])
        for session_id in self.backend.uninjected_failures():
            parsed = parse_session_id(session_id)
            if parsed is not None and parsed[1] == 1:
                uninjected.add(parsed[0])
        for record in self.records:
            cause = record.cause
            if record.phase != "targeted":
                continue
            reached = self._judge_calls[marker(cause, record.index)] > 0 if cause.judged else record.index in fired
            if cause.side == INFRA and reached:
                continue
            if record.index in uninjected:
                record.cause = UNINJECTED
            elif cause.side == INFRA:
                record.cause = Cause(f"{cause.name}: fault never reached", POLICY)

    async def watch_loop_lag(self, period_s: float = 0.05) -> None:
        """Until cancelled: how late the event loop wakes a sleeper (rollouts and fakes share it under load)."""
        while True:
            expected = time.monotonic() + period_s
            await asyncio.sleep(period_s)
            self.loop_lag_s = max(self.loop_lag_s, time.monotonic() - expected)

    async def report(self, target: str, started: float) -> ChaosReport:
        await asyncio.sleep(0.2)  # closes of cancelled calls settle
        self._attribute()
        unparsed = {h.session_id for h in self.backend.hits if h.session_id and not parse_session_id(h.session_id)}
        # Sessions none of whose closes got through (every close answered by a fault): their browser stays open.
        closes = [h for h in self.backend.hits if h.endpoint == "close_session" and h.session_id]
        faulted_closes = {h.session_id for h in closes} - {h.session_id for h in closes if not h.fault}
        left_open, left_open_total = await self.backend.sessions_left_open()
        return ChaosReport(
            target=target,
            settings=self.settings,
            records=sorted(self.records, key=lambda r: r.index),
            left_open=left_open,
            left_open_total=left_open_total,
            closes_refused=len(faulted_closes),
            attempt_seconds=self.backend.attempt_spans(),
            loop_lag_s=self.loop_lag_s,
            wall_s=time.monotonic() - started,
            unparsed_sessions=sorted(unparsed),
        )


def _seeded_call(hit: Hit) -> bool:
    """A call made after the session's seed (any tool call): the rollout holds a browser."""
    parsed = parse_session_id(hit.session_id)
    return parsed is not None and hit.endpoint.startswith("browser_")


def mix(rollouts: int, *, clean_every: int = 3, edge_cases: bool = False) -> list[Cause]:
    """``rollouts`` causes: every targeted fault (and edge case, if asked) and every policy outcome once, then every
    ``clean_every``-th rollout a clean walk and the others cycling through the faults and outcomes again."""
    faults = [*TARGETED_FAULTS, *(EDGE_CASES if edge_cases else ())]
    others = [*faults, *(c for c in POLICY_OUTCOMES if c.name != "clean walk")]
    clean = POLICY_OUTCOMES[0]
    cycle = itertools.cycle(others)
    causes = [clean, *others]
    while len(causes) < rollouts:
        causes.append(clean if len(causes) % clean_every == 0 else next(cycle))
    return causes[:rollouts]


async def run_chaos(
    backend: Backend,
    settings: ChaosSettings,
    *,
    target: str,
    targeted_rollouts: int,
    phase_rollouts: int,
    edge_cases: bool = True,
    causes: Sequence[Cause] | None = None,
) -> ChaosReport:
    """The whole run: targeted faults and policy outcomes at once, then a kill/restart phase, then a 5xx burst.

    ``causes`` replaces the default mix of the targeted phase; ``edge_cases`` adds the hang that starts near the
    deadline to the mix. ``phase_rollouts`` 0 skips the two server-wide phases.
    """
    started = time.monotonic()
    async with fj.FakeJudgeServer(model=JUDGE_MODEL) as judge:
        run = ChaosRun(backend, settings, judge=judge)
        watcher = asyncio.create_task(run.watch_loop_lag())
        try:
            await run.targeted_phase(causes or mix(targeted_rollouts, edge_cases=edge_cases))
            if phase_rollouts:
                await run.server_wide_phase("kill", phase_rollouts, server=0)
                await run.server_wide_phase("burst", phase_rollouts, server=len(backend.urls) - 1)
        finally:
            watcher.cancel()
            await close_shared_clients()
            await BinaryJudge.shared(run.judge_config).close()
        return await run.report(target, started)
