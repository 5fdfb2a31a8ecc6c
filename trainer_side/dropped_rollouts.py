"""Rollouts the drop switch removed, counted where the trainer can still see them.

With ``NEMO_GYM_BROWSER_DROP_INVALID=1`` a rollout still invalid after its attempts returns ``[]``, and verl 0.9.1's
V1 trainer stores nothing for it: the step metrics, built from what TransferQueue holds, would read an invalid rate
of 0 however many rollouts failed. So the agent loop records every rollout it drops here (:func:`record`: its prompt
group ``uid`` and its flags), and the trainer wiring (the root's ``patches.py``) takes the records back when it builds
metrics.

What it guarantees
    * Counted once: :func:`take` removes what it returns.
    * Counted at the step that consumes the rollout's prompt group: the trainer takes the records of groups that
      are no longer waiting in TransferQueue's ``train`` partition (verl's replay buffer removes a group's prompt
      key when it samples the group into a batch, or evicts it). Every record of a group exists by then: the loop
      records before it returns, and verl marks a group finished only after all its rollouts returned. In the sync
      trainer that is the step that generated the group; in the async ones, the step that trains it.
    * Validation's drops stay out of training: validation's metrics take the records of their own groups first
      (``PPOTrainer._val_metrics_update`` is given every validation group's uid).
    * One ledger per run for every process and node: a named Ray actor (:mod:`named_actors`); without Ray (tests,
      tools), one per process.
    * Never fails a rollout: a ledger that cannot be reached costs a warning and the count, not the sample.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

from ..agent_attempt.sample_flags import SampleFlags
from ..gym_contract import named_actors

logger = logging.getLogger(__name__)

LEDGER_ROLE = "nemo_gym_browser.trainer_side.dropped_rollouts"
_CALL_TIMEOUT_S = 30.0
# A ledger nobody wrote to or read for this long belongs to a run that ended: it exits.
_IDLE_EXIT_S = 24 * 3600.0


class _Records:
    """Dropped rollouts by prompt-group uid."""

    def __init__(self) -> None:
        self.by_uid: dict[str | None, list[SampleFlags]] = {}

    def add(self, uid: str | None, flags: SampleFlags) -> None:
        self.by_uid.setdefault(uid, []).append(flags)

    def take(self, waiting: Collection[str] | None, only: Collection[str] | None) -> list[SampleFlags]:
        if only is not None:
            uids = [uid for uid in only if uid in self.by_uid]
        else:
            keep = set(waiting or ())
            uids = [uid for uid in self.by_uid if uid not in keep]
        return [flags for uid in uids for flags in self.by_uid.pop(uid)]


class DropLedger:
    """The run's dropped rollouts (a Ray actor, see :mod:`named_actors`)."""

    def __init__(self, idle_exit_s: float = _IDLE_EXIT_S) -> None:
        self._records = _Records()
        self._idle_exit_s = idle_exit_s
        self._last_used = time.monotonic()
        self._watch: asyncio.Task[None] | None = None

    def _used(self) -> None:
        self._last_used = time.monotonic()
        if self._watch is None and named_actors.in_actor():
            self._watch = named_actors.exit_when_idle(self._idle, check_every_s=600.0)

    def _idle(self) -> bool:
        # The trainer reads it every step: a day without a read or a write means the run is over.
        return time.monotonic() - self._last_used > self._idle_exit_s

    async def add(self, uid: str | None, flags: SampleFlags) -> None:
        self._used()
        self._records.add(uid, flags)

    async def take(
        self, waiting: Collection[str] | None = None, only: Collection[str] | None = None
    ) -> list[SampleFlags]:
        """Remove and return the records of every group not in ``waiting`` (or of the groups in ``only``)."""
        self._used()
        return self._records.take(waiting, only)


_local = _Records()  # the ledger of a process without Ray


async def record(uid: str | None, flags: SampleFlags) -> None:
    """Count one dropped rollout of prompt group ``uid`` (its flags, invalid). Never raises."""
    try:
        if not named_actors.ray_connected():
            _local.add(uid, flags)
            return
        for attempt in range(2):
            try:
                ledger = named_actors.job_actor(DropLedger, LEDGER_ROLE)
                await asyncio.wait_for(ledger.add.remote(uid, flags), _CALL_TIMEOUT_S)
                return
            except Exception as exc:
                if attempt or not named_actors.actor_died(exc):
                    raise
                named_actors.forget(LEDGER_ROLE)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning("dropped rollout of group %s not counted in the step metrics: %s", uid, exc)


def take(*, waiting: Collection[str] | None = None, only: Collection[str] | None = None) -> list[SampleFlags]:
    """Synchronous :meth:`DropLedger.take` for the trainer (which is not inside an event loop). Never raises."""
    if not named_actors.ray_connected():
        return _local.take(waiting, only)
    import ray

    try:
        ledger = ray.get_actor(named_actors.actor_name(LEDGER_ROLE), namespace=named_actors.NAMESPACE)
    except ValueError:  # nothing was ever dropped in this run
        return []
    try:
        return ray.get(ledger.take.remote(waiting, only), timeout=_CALL_TIMEOUT_S)
    except Exception as exc:
        logger.warning("could not read the dropped-rollout ledger; this step's metrics miss its drops: %s", exc)
        return []
