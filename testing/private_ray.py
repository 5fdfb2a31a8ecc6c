"""A private Ray instance on 127.0.0.1 for tests and benchmarks: never a cluster someone else started, never beyond
loopback.

Ray replaces a loopback node address with the machine's outward address unless its cluster mode is off:
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is read at import by Ray's own processes, and the calling process imported
Ray already, hence its constant is set too. Both are restored on exit, and Ray is shut down.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def private_ray(num_cpus: int = 2, *, worker_env: Mapping[str, str] | None = None) -> Iterator[None]:
    """``ray.init`` a new local instance; ``worker_env`` is set only while Ray starts, so its processes inherit it
    and this process does not keep it."""
    import ray
    import ray._private.ray_constants as ray_constants

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process")
    saved = (os.environ.get(LOOPBACK_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER)
    os.environ[LOOPBACK_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with _environment(worker_env or {}):
            ray.init(
                address="local",
                num_cpus=num_cpus,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        yield
    finally:
        ray.shutdown()
        _restore(LOOPBACK_ONLY_ENV, saved[0])
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block; what they replaced comes back after it."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            _restore(key, value)


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
