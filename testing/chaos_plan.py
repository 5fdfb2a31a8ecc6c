"""The plan of a chaos run: what happens to each rollout's first attempt, and the run's timeouts and sizes.

Every rollout is given one *cause* (:class:`Cause`) for its first attempt:

* an infrastructure fault aimed at that attempt's session: a 5xx, a call that hangs past its timeout, a dropped
  connection, a lost session (on ``browser_click``), a failed seed, a verify that cannot grade, a judge that stops
  answering (tasks without ``verifier_metadata``);
* a policy outcome: a clean walk, a wrong answer, an element id not on the page, arguments the server rejects
  (422), a URL of its own that fails to load, a URL the guard refuses, no answer at all, running out of turns,
  running out of environment time (slow pages: the deadline does not count generation), a task the judge grades;
* or, in the server-wide phases, whatever hits it: a server killed and restarted while the phase's sessions are
  open (every session open on it then is a victim), and a burst of 503s on every call a server gets for a while
  (every session that received one is a victim; the rest had no fault).

Each cause comes with the scripted policy's behaviour for it (:func:`script_for`) and the marker by which the
policy and the fake judge know its row (:func:`marker`); :func:`mix` orders a targeted phase's causes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..local import scripted_policy as sp

VERIFIER = {"url_contains": "about.html"}
ANSWER = "ALPHA-42"
DEAD_URL = "http://127.0.0.1:9/"  # a loopback port nothing listens on: the navigation fails, nothing leaves the host
REFUSED_URL = "http://169.254.169.254/latest/meta-data/"

INFRA = "infrastructure"
POLICY = "policy"
NO_FAULT = "no fault (server-wide phase)"


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


def script_for(cause: Cause) -> sp.Script:
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
    # Resumes per attempt (resume.max_per_episode). 0: each fault ends its attempt and the blame is read per attempt.
    # Above 0, as users get it (the recipe's default is 4): faults are resumed and the report reads blame, time and
    # validity with the resumes (chaos_report).
    resume_max_per_episode: int = 0
    max_sessions_per_server: int = 64
    max_assistant_turns: int = 8
    think_time_s: float = 0.0  # every turn of every rollout
    phase_think_time_s: float = 0.3  # turns of the server-wide phases, so their sessions stay open a while
    judge_timeout_s: float = 1.0
    judge_max_attempts: int = 2
    burst_s: float = 0.5

    @property
    def slow_call_s(self) -> float:
        """How long each slow observe of the deadline rows waits: the deadline row reaches its deadline two turns
        before its turn limit (the shortest wait that does)."""
        return self.episode_deadline_s / max(1, self.max_assistant_turns - 2)

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
