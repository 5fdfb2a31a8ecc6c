"""A fixed share of every server's cap per worker: the alternative ``bench/placement_share.py`` measures.

:func:`static_share` deals the slots from the worker's rank and the number of workers, and
:class:`StaticSharePlacement` holds this process's sessions within its share: no actor, no leases. Why the recipe
uses the run-wide authority of :mod:`nemo_gym_browser.gym_contract.placement` instead: ``docs/benchmarks.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..gym_contract.placement import Grant, ProcessPlacement, SessionTicket


def static_share(cap: int, servers: Sequence[str], rank: int, workers: int) -> dict[str, int]:
    """The slots worker ``rank`` of ``workers`` may hold on each server, decided without asking anyone.

    The ``cap * len(servers)`` slots are dealt server by server, one to each worker in turn: every server's slots
    sum to ``cap`` over the workers, workers' totals differ by at most one, and a worker's slots land on different
    servers before any server gets two of them (when ``workers >= cap``).
    """
    if not 0 <= rank < workers:
        raise ValueError(f"worker rank {rank} is not in [0, {workers})")
    if cap * len(servers) < workers:
        raise ValueError(f"{cap} sessions on each of {len(servers)} servers cannot give each of {workers} workers one")
    share = dict.fromkeys(servers, 0)
    for index, server in enumerate(servers):
        share[server] = sum(1 for slot in range(index * cap, (index + 1) * cap) if slot % workers == rank)
    return share


class StaticSharePlacement(ProcessPlacement):
    """The rule over this process's sessions, within a fixed share of every server's cap (:func:`static_share`).

    No process talks to another: the cap holds per server as long as every worker sharing the servers has a
    distinct ``rank`` and the same ``workers``. The slots of a worker that dies are lost and its browsers stay open
    on the servers until they restart (nothing else knows about them); an idle worker's slots stay idle.
    """

    def __init__(self, rank: int, workers: int) -> None:
        super().__init__()
        self.rank = rank
        self.workers = workers
        self._dealt: tuple[tuple[str, ...], int] | None = None

    async def acquire(self, servers: Sequence[str], cap: int, ticket: SessionTicket) -> Grant:
        if self._dealt != (tuple(servers), cap):
            self.book.limit(static_share(cap, servers, self.rank, self.workers))
            self._dealt = (tuple(servers), cap)
        return await super().acquire(servers, cap, ticket)
