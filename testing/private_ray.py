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
    extra = dict(worker_env or {})
    try:
        os.environ.update(extra)
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        finally:
            for key in extra:
                os.environ.pop(key, None)
        yield
    finally:
        ray.shutdown()
        if saved[0] is None:
            os.environ.pop(LOOPBACK_ONLY_ENV, None)
        else:
            os.environ[LOOPBACK_ONLY_ENV] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]
