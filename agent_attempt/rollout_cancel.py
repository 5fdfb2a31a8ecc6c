"""Cancelling a cut generation on the rollout server, not only in this process.

Contract: :func:`track_rollout_requests` wraps, once per client object, the rollout-server handle verl's
``LLMServerClient`` gets from its private ``_acquire_server``, so each request's Ray ``ObjectRef`` is noted;
:func:`generate_within` awaits a generation for at most a given time, and a generation cut by that time or by
cancellation has its requests ``ray.cancel``-ed on the server (vLLM aborts them). Why: verl 0.9.1 gives each turn a
fresh vLLM request id it does not expose, and cancelling the task that awaits an ``ObjectRef`` leaves the actor's
task running, so vLLM would decode a cut generation for nobody (``docs/agent-loop.md#session-hold-limit``).

Lifetimes: a generation's requests are noted in a context variable set for one :func:`generate_within` call only;
a tracked client stays tracked for its own lifetime.

Errors: a verl whose client no longer looks as expected is refused with :class:`RolloutCancelUnsupported`
(:func:`check_acquire_server`), never wrapped blindly.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Awaitable
from typing import Any

logger = logging.getLogger(__name__)

# The rollout-server requests (Ray ObjectRefs) of the generation running in this context.
_ROLLOUT_REQUESTS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "nemo_gym_browser_rollout_requests", default=None
)
_TRACKING_ATTRIBUTE = "_nemo_gym_browser_tracks_requests"
# What verl 0.9.1's LLMServerClient looks like to this module: ``_acquire_server(request_id, **extra)`` returning
# ``(server_id, actor handle)``, called by a ``generate`` of the client's classes, which then calls
# ``handle.generate.remote`` (subclasses such as FullyAsyncLLMServerClient reach it through ``super().generate``).
_ACQUIRE_PARAMS = ("request_id",)
_GENERATE_CALLS = ("_acquire_server", "generate", "remote")


class RolloutCancelUnsupported(RuntimeError):
    """verl's rollout client is not the one this module was written for; wrapping it would be guesswork."""


class _TrackedGenerate:
    """``server.generate`` of a rollout server's actor handle that notes each request it submits."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ref = self._method.remote(*args, **kwargs)
        requests = _ROLLOUT_REQUESTS.get()
        if requests is not None:
            requests.append(ref)
        return ref

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)


class _TrackedServer:
    """A rollout server's actor handle whose ``generate`` requests are noted; everything else passes through."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @property
    def generate(self) -> _TrackedGenerate:
        return _TrackedGenerate(self._handle.generate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def check_acquire_server(client: Any) -> None:
    """Raise :class:`RolloutCancelUnsupported` unless ``client`` has verl 0.9.1's ``_acquire_server`` contract."""
    where = f"{type(client).__module__}.{type(client).__qualname__}"
    acquire = client._acquire_server
    problems = []
    if not inspect.iscoroutinefunction(acquire):
        problems.append("_acquire_server is not a coroutine function")
    try:
        parameters = inspect.signature(acquire).parameters
    except (TypeError, ValueError):
        parameters = {}
        problems.append("_acquire_server has no signature")
    missing = [name for name in _ACQUIRE_PARAMS if name not in parameters]
    if missing:
        problems.append(f"_acquire_server no longer takes {missing} (has {list(parameters)})")
    if parameters and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        problems.append(f"_acquire_server no longer takes **extra (has {list(parameters)})")
    if not any(_calls_all(owner.__dict__.get("generate"), _GENERATE_CALLS) for owner in type(client).__mro__):
        problems.append(f"no generate of its classes calls {list(_GENERATE_CALLS)}")
    if problems:
        raise RolloutCancelUnsupported(
            f"nemo_gym_browser cannot track rollout requests of {where} (verl {_verl_version()}): "
            + "; ".join(problems)
            + ". The recipe was written for the verl version in REQUIRED_VERL.txt; install that version."
        )


def _calls_all(function: Any, names: tuple[str, ...]) -> bool:
    """Whether ``function`` (decorators unwrapped) names every one of ``names`` in its code."""
    if function is None:
        return False
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and all(name in code.co_names for name in names)


def _verl_version() -> str:
    try:
        import verl
    except ImportError:
        return "not installed"
    return str(getattr(verl, "__version__", "unknown"))


def track_rollout_requests(client: Any) -> bool:
    """Let a cut generation be cancelled on the rollout server behind verl's ``LLMServerClient`` (see the module
    docstring). Returns whether the client is tracked: False for a client without ``_acquire_server`` (a
    generation cut then is cancelled in this process only); raises :class:`RolloutCancelUnsupported` for one whose
    ``_acquire_server`` differs from verl 0.9.1's."""
    acquire = getattr(client, "_acquire_server", None)
    if acquire is None:
        return False
    if getattr(client, _TRACKING_ATTRIBUTE, False):
        return True
    check_acquire_server(client)

    async def acquire_tracked(request_id: str, **extra: Any) -> tuple[str, Any]:
        server_id, handle = await acquire(request_id, **extra)
        return server_id, _TrackedServer(handle)

    client._acquire_server = acquire_tracked
    setattr(client, _TRACKING_ATTRIBUTE, True)
    return True


def _cancel_rollout_requests(requests: list[Any], label: str) -> None:
    if not requests:
        return
    import ray  # only reached with verl's Ray-backed client

    for ref in requests:
        try:
            ray.cancel(ref)
        except Exception as exc:  # a request already finished or its server gone: nothing left to stop
            logger.debug("%s: cancelling a rollout-server request failed: %r", label, exc)
    logger.info("%s: cancelled %d rollout-server request(s) of a cut generation", label, len(requests))


async def generate_within(generation: Awaitable[Any], timeout_s: float, label: str) -> Any:
    """Await ``generation`` for at most ``timeout_s``; a generation cut by the timeout or by cancellation is also
    cancelled on the rollout server (see :func:`track_rollout_requests`), never left running."""
    requests: list[Any] = []
    token = _ROLLOUT_REQUESTS.set(requests)  # asyncio.wait_for's task copies this context
    try:
        return await asyncio.wait_for(generation, timeout_s)
    except BaseException:
        _cancel_rollout_requests(requests, label)
        raise
    finally:
        _ROLLOUT_REQUESTS.reset(token)
