"""Chaos runs of the real agent loop: inject infrastructure faults and policy mistakes, then check who got blamed.

A run: rollouts of the recipe's real ``BrowserToolAgentLoop`` (one loop object per episode, built as verl builds
them) run concurrently against one or more environment servers, driven by a scripted policy, in three phases (every
cause at once, a server killed and restarted, a 5xx burst). Each rollout's first attempt, and only it, gets one cause
(:mod:`~nemo_gym_browser.testing.chaos_plan`), aimed by session id (:func:`parse_session_id`; a run fails loudly if
one does not parse) at the first session that attempt seeds: a resume's new session is sound. Causes are settled by
what happened, not by the plan: a planned fault that never fired leaves a policy outcome, and a first attempt the real
server failed by itself is listed as the environment failing on its own. With resuming on, each rollout's trajectory
record (in a temporary folder) gives the replay seconds a resumed attempt's time bound allows.

The parts: :mod:`~nemo_gym_browser.testing.chaos_plan` (causes, scripts, settings), this module (the run),
:mod:`~nemo_gym_browser.testing.chaos_backends` (the servers and how faults reach them),
:mod:`~nemo_gym_browser.testing.chaos_report` (what the run found, :class:`ChaosReport`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import math
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from .. import judge as judge_module
from ..browser_agent_loop import close_shared_clients
from ..gym_contract.session_ids import parse_session_id
from ..judge import BinaryJudge, JudgeConfig
from ..local import scripted_policy as sp
from ..local.chat_tokenizer import build_chat_tokenizer
from ..local.in_process_loop import agent_loop_entry, compose_trainer_config, load_tools, make_row
from . import fake_judge as fj
from .benchmarking import LoopFactory
from .chaos_backends import Backend, Hit
from .chaos_plan import (
    ANSWER,
    BURST_5XX,
    BURST_PHASE,
    DEAD_URL,
    HANG_NEAR_DEADLINE,
    INFRA,
    KILL_PHASE,
    NONE,
    POLICY,
    SERVER_KILLED,
    UNINJECTED,
    VERIFIER,
    Cause,
    ChaosSettings,
    marker,
    mix,
    script_for,
)
from .chaos_report import ChaosReport, RolloutRecord

logger = logging.getLogger(__name__)

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
JUDGE_MODEL = "fake-judge"


class ChaosRun:
    """Runs the phases of a chaos run against a backend and builds the :class:`ChaosReport`."""

    def __init__(
        self, backend: Backend, settings: ChaosSettings, *, judge: fj.FakeJudgeServer, records_dir: Path
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.judge = judge
        self.records_dir = records_dir
        self.tokenizer = build_chat_tokenizer()
        config = compose_trainer_config(
            overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={settings.max_assistant_turns}"]
        )
        judge_settings = {
            "base_url": judge.base_url,
            "model": JUDGE_MODEL,
            "timeout_s": settings.judge_timeout_s,
            "max_attempts": settings.judge_max_attempts,
            "backoff_s": 0.05,
        }
        self.judge_config = JudgeConfig.from_mapping(judge_settings)
        entry = agent_loop_entry(
            environment=settings.environment(backend.urls),
            episode_deadline_s=settings.episode_deadline_s,
            max_attempts=settings.max_attempts,
            resample_backoff_s=settings.resample_backoff_s,
            resume={"max_per_episode": settings.resume_max_per_episode},
            trajectory_dir=str(records_dir) if settings.resume_max_per_episode else None,  # only replays need them
            url_policy={"allowlist": [DEAD_URL.rstrip("/")]},
            judge=judge_settings,
        )
        tools = [*load_tools(), *load_tools(native=True)]  # the single tool and NeMo Gym's five (for 422s)
        self.factory = LoopFactory(entry, tools, config, self.tokenizer)
        self.records: list[RolloutRecord] = []
        self._plan: dict[int, Cause] = {}
        self._first_sessions: dict[int, str] = {}  # per rollout: the first session its first attempt seeded
        self._indices = itertools.count()
        self._judge_calls: collections.Counter[str] = collections.Counter()
        self.loop_lag_s = 0.0
        self._fault_begun = asyncio.Event()  # a server-wide phase's fault has begun: its held rollouts walk on
        judge.default = fj.Behaviour(respond=self._judge_behaviour)
        backend.targeting = self._targeting
        # The deadline counts environment time only, so the rows that must reach it spend it in slow observes. Rollouts
        # and fakes share one event loop, which a loaded machine wakes seconds late, so a slow observe is as short as
        # the turn limit allows (the deadline row needs two turns fewer than it has): the rest of the per-call timeout
        # absorbs that lag. HANG_NEAR_DEADLINE makes just enough of them for less than one per-call timeout to be
        # left, then the click hangs; lag only delays the click, and it has the rest of that timeout to spare.
        slow_s, deadline, call = settings.slow_call_s, settings.episode_deadline_s, settings.call_timeout_s
        if slow_s > call / 2:
            raise ValueError(
                f"a slow observe ({slow_s:.2f} s, episode_deadline_s over max_assistant_turns - 2) leaves less than "
                f"half of call_timeout_s={call:g} for the event loop's lag: raise max_assistant_turns"
            )
        self.near_deadline_observes = math.floor(max(0.0, deadline - call) / slow_s) + 1
        backend.slow_s = slow_s

    # --- who gets which fault ---

    def _targeting(self, server: int, session_id: str | None, endpoint: str) -> str | None:
        parsed = parse_session_id(session_id)
        if parsed is None or parsed[1] != 1:
            return None
        # Only the attempt's first session (its seed is the first call seen of it): a resume's new one is sound.
        if self._first_sessions.setdefault(parsed[0], session_id) != session_id:
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

    def _think(self, view: sp.PolicyView) -> float | Awaitable[Any]:
        task = view.task
        if f"{KILL_PHASE.name}]" in task or f"{BURST_PHASE.name}]" in task:
            if view.turn > 0 and not self._fault_begun.is_set():
                # Past its first call a phase rollout keeps its session open until the fault: however late a loaded
                # event loop lets the last one seed, the first ones have not finished yet.
                return self._fault_begun.wait()
            return self.settings.phase_think_time_s
        return self.settings.think_time_s

    async def _rollout(self, index: int, cause: Cause, phase: str) -> RolloutRecord:
        record = RolloutRecord(index, cause, phase)
        script = script_for(cause)
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
        """``rollouts`` clean walks, each holding its session open after its first call; once all have made one,
        kill/restart ``server`` or burst 5xx on it, then let them walk on."""
        indices = [next(self._indices) for _ in range(rollouts)]
        phase_cause = KILL_PHASE if kind == "kill" else BURST_PHASE
        self._fault_begun = asyncio.Event()
        tasks = [asyncio.create_task(self._rollout(i, phase_cause, kind)) for i in indices]
        wanted = set(indices)

        def all_seeded() -> bool:
            seeded = {parse_session_id(h.session_id)[0] for h in self.backend.hits if _seeded_call(h)}
            return wanted <= seeded or all(t.done() for t in tasks)

        try:
            await _until(all_seeded, self.settings.seed_timeout_s * 2 + 10)
            if kind == "kill":
                victims = {p[0] for p in map(parse_session_id, self.backend.open_session_ids(server)) if p} & wanted
                await self.backend.kill_and_restart(server)
            else:
                victims = await self._burst(server, wanted)
        finally:
            self._fault_begun.set()
        records = await asyncio.gather(*tasks)
        for record in records:
            record.cause = (SERVER_KILLED if kind == "kill" else BURST_5XX) if record.index in victims else NONE
        self.records += records

    async def _burst(self, server: int, wanted: set[int]) -> set[int]:
        """503 on every call ``server`` gets for ``burst_s``, and on until each first-attempt session of ``wanted`` open
        on it has called it (the held rollouts call as soon as the burst begins), at most one per-call timeout longer.
        Returns the rollouts whose first attempt got a 503 (on a close alone it does not touch the sample: the verdict
        is in)."""
        hits = self.backend.hits
        closed = {h.session_id for h in hits if h.endpoint == "close_session"}
        held = {
            h.session_id
            for h in hits
            if h.server == server and h.endpoint == "seed_session" and _first_attempt_of(h, wanted)
        } - closed
        first = len(hits)
        with self.backend.bursting(server):
            self._fault_begun.set()
            await asyncio.sleep(self.settings.burst_s)
            await _until(lambda: held <= {h.session_id for h in hits[first:]}, self.settings.call_timeout_s)
        return {
            parse_session_id(h.session_id)[0]
            for h in hits[first:]
            if h.fault == "burst" and h.endpoint != "close_session" and _first_attempt_of(h, wanted)
        }

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
            attempt_sessions=self.backend.sessions_per_attempt(),
            replay_seconds=self._replay_seconds(),
            loop_lag_s=self.loop_lag_s,
            wall_s=time.monotonic() - started,
            unparsed_sessions=sorted(unparsed),
        )

    def _replay_seconds(self) -> dict[str, float]:
        """Per final attempt (``<rollout id>.<attempt>``) that tried to resume: the seconds its resumes took, seed of
        the new session and replay, failed tries included (the episode's ``resumes``, from its trajectory record)."""
        seconds: dict[str, float] = {}
        for path in sorted(self.records_dir.rglob("*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                if record.get("resumes"):
                    key = f"{record['episode_id']}.{record['flags']['attempts']}"
                    seconds[key] = sum(float(resume["seconds"]) for resume in record["resumes"])
        return seconds


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``condition`` until it holds or ``timeout_s`` has passed."""
    give_up_at = time.monotonic() + timeout_s
    while time.monotonic() < give_up_at:
        if condition():
            return
        await asyncio.sleep(0.02)


def _first_attempt_of(hit: Hit, indices: set[int]) -> bool:
    """The call was made by the first attempt of one of the rollouts ``indices``."""
    parsed = parse_session_id(hit.session_id)
    return parsed is not None and parsed[0] in indices and parsed[1] == 1


def _seeded_call(hit: Hit) -> bool:
    """A call made after the session's seed (any tool call): the rollout holds a browser."""
    parsed = parse_session_id(hit.session_id)
    return parsed is not None and hit.endpoint.startswith("browser_")


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
    # No verdict cache: every judged rollout asks the judge, so a judge fault reaches each rollout it targets.
    with (
        mock.patch.object(judge_module, "VERDICT_CACHE_SIZE", 0),
        tempfile.TemporaryDirectory(prefix="chaos-trajectories-") as records_dir,
    ):
        return await _run_phases(
            backend, settings, target, started, targeted_rollouts, phase_rollouts, edge_cases, causes, Path(records_dir)
        )


async def _run_phases(
    backend: Backend,
    settings: ChaosSettings,
    target: str,
    started: float,
    targeted_rollouts: int,
    phase_rollouts: int,
    edge_cases: bool,
    causes: Sequence[Cause] | None,
    records_dir: Path,
) -> ChaosReport:
    async with fj.FakeJudgeServer(model=JUDGE_MODEL) as judge:
        run = ChaosRun(backend, settings, judge=judge, records_dir=records_dir)
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
