"""Injected faults: the project's fault proxy in front of a real environment server, and the rules it strikes by.

What it owns
    * :class:`InjectedFaults`: the fault proxy (:mod:`nemo_gym_browser.local.faults.proxy`) between the trainer's
      rollouts and an environment server, on its own event loop in a daemon thread; started on ``__enter__``,
      stopped on ``__exit__`` (the loop closed even when stopping the proxy fails).
    * The rules, each deterministic whatever the timing: :func:`random_faults` (a share of sessions fails at one
      endpoint, verify by default), :func:`browser_call_faults` (each browser action call fails on its own, so
      exposure grows with browsing), :func:`planned_faults` (per dataset row, :class:`RowFault`).
    * :class:`FaultSpec`: what a run injects (``RunSpec.faults``, the CLI's ``--fault-*``), naming the first two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..background_loop import BackgroundLoop

# Where injected faults strike: "verify" spoils a share of sessions after the policy acted (random_faults);
# "browser-call" fails each browser action call on its own (browser_call_faults); "seed" leaves a share of tasks
# unseedable, every attempt of every rollout of theirs (unseedable_tasks): rollouts that never reach the model.
FAULT_POINTS = ("verify", "browser-call", "seed")
# What a faulted call meets (Fault kinds), each an infrastructure failure the loop resamples. At a browser call /
# at verify the loop records: "status" (a 503) server_error / verify_unavailable; "lose_session" (the session cookie
# stripped: the server no longer knows the session) session_lost / session_lost; "hang" (held until the client gives
# up) timeout after environment.call_timeout_s / verify_unavailable after verify_timeout_s. Not "drop": observe and
# navigate are retried on a dropped connection, each retry a call of its own, so their failure rate would not be the
# rate asked for.
FAULT_KINDS = ("status", "lose_session", "hang")


def _check_rate(rate: float) -> None:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"the fault rate must be in [0, 1], not {rate}")


@dataclass(frozen=True)
class FaultSpec:
    """The infrastructure failures the fault proxy injects into a run's training sessions (see :meth:`rule`)."""

    rate: float = 0.0  # "verify": the share of sessions faulted; "browser-call": each browser call's chance
    at: str = "verify"  # one of FAULT_POINTS
    kind: str = "status"  # one of FAULT_KINDS

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if self.at not in FAULT_POINTS:
            raise ValueError(f"faults strike at one of {FAULT_POINTS}, not {self.at!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"the fault kind must be one of {FAULT_KINDS}, not {self.kind!r}")
        if self.at == "seed" and self.kind == "lose_session":
            raise ValueError("a seed has no session to lose: use status or hang at seed")

    def rule(self, seed: int, spare_tasks: frozenset[str] = frozenset()) -> Callable[[Any], Any]:
        """The proxy rule: :func:`random_faults` at verify or :func:`browser_call_faults`, sparing ``spare_tasks``."""
        if self.at == "browser-call":
            return browser_call_faults(self.rate, seed, kind=self.kind, spare_tasks=spare_tasks)
        if self.at == "seed":
            return unseedable_tasks(self.rate, seed, kind=self.kind, spare_tasks=spare_tasks)
        return random_faults(self.rate, seed, spare_tasks=spare_tasks, kind=self.kind)


class InjectedFaults:
    """The fault proxy in front of ``upstream``, on its own event loop in a daemon thread.

    ``with InjectedFaults(env.url, rule) as faults: ... faults.url ...``; after the run, ``open_session_ids`` are
    the sessions seeded through the proxy that no verify or close released, and ``counts()`` what was injected.
    """

    _TIMEOUT_S = 30.0

    def __init__(self, upstream: str, rule: Callable[[Any], Any] | None = None) -> None:
        from .proxy import FaultProxy

        self._loop = BackgroundLoop("fault-proxy")
        self._proxy = FaultProxy(upstream)
        self._rule = rule

    def __enter__(self) -> InjectedFaults:
        self._loop.open()
        try:
            self._loop.run(self._proxy.start(), timeout_s=self._TIMEOUT_S)
        except BaseException:
            self._loop.close()
            raise
        self._proxy.set_rule(self._rule)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._loop.run(self._proxy.close(), timeout_s=self._TIMEOUT_S)
        finally:
            self._loop.close()

    @property
    def url(self) -> str:
        return self._proxy.url

    @property
    def open_session_ids(self) -> tuple[str, ...]:
        return self._proxy.open_session_ids

    @property
    def log(self) -> list[Any]:
        return list(self._proxy.log)

    def counts(self) -> dict[str, int]:
        from .proxy import fault_counts

        return fault_counts(self.log)


@dataclass(frozen=True)
class RowFault:
    """Break ``endpoint`` on the given attempts of ``rollouts`` rollouts of a dataset row, in the order they reach
    the proxy: the first ``rollouts`` of them, or those after the first ``skip``. ``fault="regrade"`` does not
    break the call: it plants a verify reward of 1.0 (a success the policy did not have to earn)."""

    endpoint: str  # "seed_session", "verify", "browser_click", ...
    attempts: tuple[int, ...]
    rollouts: int
    fault: str = "status"  # "status" (503), "drop", "lose_session", "hang", "regrade"
    skip: int = 0


def proxy_fault(name: str) -> Any:
    """The :class:`~nemo_gym_browser.local.faults.kinds.Fault` a rule here answers with, by ``name``."""
    from .kinds import Fault

    make = {
        "status": lambda: Fault.status(503),
        "drop": lambda: Fault.drop_connection(None),
        "lose_session": Fault.lose_session,
        "hang": Fault.hang,  # held until the client gives up (its call timeout), then never forwarded
        "regrade": lambda: Fault.regrade(1.0),
        "fail_seed": Fault.fail_seed,  # the server's own 500 when a start page never loads
    }
    if name not in make:
        raise ValueError(f"unknown fault {name!r}; expected one of {sorted(make)}")
    return make[name]()


def _unit_draw(*parts: object) -> float:
    """A number in [0, 1) that is a hash of ``parts``: the same every run, whatever the order of the requests."""
    import hashlib

    digest = hashlib.sha256(":".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def planned_faults(plan: Mapping[int, RowFault | Sequence[RowFault]]) -> Callable[[Any], Any]:
    """A proxy rule from a plan keyed by dataset row index (the ``index`` column), deterministic whatever the timing.

    Rollouts are told apart by the id the loop gives each (``r<index>-<hex>``) and numbered in the order they first
    reach the proxy, whichever of the group's episodes they are; a row's fault hits the rollouts numbered
    ``skip`` .. ``skip + rollouts - 1``. A row may carry several faults (for different rollouts or endpoints).
    """
    from ...gym_contract.session_ids import parse_session_id

    faults = {index: (f,) if isinstance(f, RowFault) else tuple(f) for index, f in plan.items()}
    for row_fault in (f for row in faults.values() for f in row):
        proxy_fault(row_fault.fault)  # an unknown name fails here, not mid-run
    seen: dict[int, list[str]] = {}  # per row, its rollouts in the order they first reached the proxy
    lock = threading.Lock()

    def rule(request: Any) -> Any:
        parsed = parse_session_id(request.session_id)
        if parsed is None:
            return None
        index, attempt = parsed
        if index not in faults:
            return None
        rollout = request.session_id.split(".", 1)[0]
        with lock:
            order = seen.setdefault(index, [])
            if rollout not in order:
                order.append(rollout)
            position = order.index(rollout)
        for row_fault in faults[index]:
            chosen = row_fault.skip <= position < row_fault.skip + row_fault.rollouts
            if chosen and request.endpoint == row_fault.endpoint and attempt in row_fault.attempts:
                return proxy_fault(row_fault.fault)
        return None

    return rule


def random_faults(
    rate: float,
    seed: int,
    endpoint: str = "verify",
    spare_tasks: frozenset[str] = frozenset(),
    kind: str = "status",
) -> Callable[[Any], Any]:
    """A proxy rule that fails ``endpoint`` for a fraction ``rate`` of all sessions (each attempt drawn anew).

    The draw is a hash of the session id and ``seed``, so it does not depend on request order or timing; over many
    sessions the fraction converges to ``rate``. A fault at verify spoils an episode after the policy acted, however
    much it browsed: the recipe re-runs it (a 503 is ``verify_unavailable``, see ``FAULT_KINDS``), stock GRPO scores
    it 0. Sessions of ``spare_tasks`` (e.g. the held-back tasks validation runs) are never faulted, so validation
    measures the policy alone. ``kind`` names the :func:`proxy_fault` (default ``status``, a 503).
    """
    _check_rate(rate)
    proxy_fault(kind)

    def rule(request: Any) -> Any:
        if request.endpoint != endpoint or not request.session_id or request.task_id in spare_tasks:
            return None
        return proxy_fault(kind) if _unit_draw(seed, request.session_id) < rate else None

    return rule


def browser_call_faults(
    rate: float, seed: int, kind: str = "status", spare_tasks: frozenset[str] = frozenset()
) -> Callable[[Any], Any]:
    """A proxy rule that fails each browser action call (observe, navigate, click, type) with probability ``rate``.

    Real infrastructure fails while the browser works, so an episode is exposed in proportion to the browser calls
    it makes, and one that answers at once (``finish`` first) is never hit: seed, finish, verify and close are never
    faulted. Each call is drawn on its own, from a hash of ``seed``, the session id and the call's index among its
    session's browser calls (counted by the rule, per session), so the draw depends neither on timing nor on other
    sessions' traffic. The loop records ``kind`` (see ``FAULT_KINDS``) as ``server_error`` (status), ``session_lost``
    (lose_session) or ``timeout`` (hang, after the client's ``call_timeout_s``) and goes on in a new session, drawn
    anew: the same attempt resumed there (its calls so far replayed, each drawn too), or, past the resume budgets or
    with resuming off, the rollout re-run. Sessions of ``spare_tasks`` are never faulted.
    """
    from ...gym_contract.browser_calls import BROWSER_FINISH, TOOL_NAMES

    _check_rate(rate)
    proxy_fault(kind)
    browser_calls = frozenset(TOOL_NAMES) - {BROWSER_FINISH}
    calls: dict[str, int] = {}  # session id -> its browser calls so far; forgotten at its close
    lock = threading.Lock()

    def rule(request: Any) -> Any:
        if not request.session_id or request.task_id in spare_tasks:
            return None
        if request.endpoint == "close_session":
            with lock:
                calls.pop(request.session_id, None)
            return None
        if request.endpoint not in browser_calls:
            return None
        with lock:
            index = calls.get(request.session_id, 0)
            calls[request.session_id] = index + 1
        return proxy_fault(kind) if _unit_draw(seed, request.session_id, index) < rate else None

    return rule


def unseedable_tasks(
    rate: float, seed: int, kind: str = "status", spare_tasks: frozenset[str] = frozenset()
) -> Callable[[Any], Any]:
    """A proxy rule under which a share ``rate`` of the tasks can never be seeded, on any attempt of any rollout.

    The draw is a hash of ``seed`` and the task id, so a drawn task's whole group fails every attempt (its rollouts
    never reach the model: each is a placeholder sample, or dropped), wherever it lands in a batch. ``status``
    answers the seed as the server does when the start page never loads (a 500: ``seed_failed``); ``hang`` holds it
    until the client's ``seed_timeout_s``. Sessions of ``spare_tasks`` are never faulted.
    """
    _check_rate(rate)
    fault = "fail_seed" if kind == "status" else kind
    proxy_fault(fault)

    def rule(request: Any) -> Any:
        if request.endpoint != "seed_session" or not request.task_id or request.task_id in spare_tasks:
            return None
        return proxy_fault(fault) if _unit_draw(seed, "seed", request.task_id) < rate else None

    return rule
