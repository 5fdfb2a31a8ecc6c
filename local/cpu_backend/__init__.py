"""A CPU trainer backend so verl 0.9.1's real ``python -m verl.trainer.main_ppo`` runs on a machine without a GPU.

A stand-in for vLLM and the CUDA platform, for tests, CI and the local rehearsal; never a default and never on a
GPU node: nothing selects it unless :func:`cpu_env` and :func:`cpu_overrides` are given, and both halves refuse to
start where ``torch.cuda.is_available()`` unless ``NEMO_GYM_BROWSER_CPU_BACKEND_FORCE=1``. The halves (``plugin``
registers both in every process that imports verl): ``platform``, a verl platform named ``cpu``
(``VERL_PLATFORM=cpu``: ``torch.cpu``, gloo, two workarounds for verl 0.9.1 on CPU); ``rollout``, a rollout backend
named ``hfcpu`` whose Ray actor (``server.HFCpuServer``) serves a Hugging Face model token-in/token-out with
verl's sampling parameters, log-probs, aborts and per-step weight updates.

:func:`cpu_env` (exported before Ray starts) and :func:`cpu_overrides` are the one source of the settings; why each:
``docs/rehearsal-and-cpu-training.md#the-cpu-backend-in-detail``. Importing this package is cheap: no torch, verl
or Ray import happens here.
"""

from __future__ import annotations

__all__ = [
    "FORCE_ENV",
    "PLATFORM_NAME",
    "PLUGIN_MODULE",
    "ROLLOUT_NAME",
    "THREADS_KEY",
    "cpu_env",
    "cpu_overrides",
]

PLATFORM_NAME = "cpu"
ROLLOUT_NAME = "hfcpu"
PLUGIN_MODULE = "nemo_gym_browser.local.cpu_backend.plugin"
# Lets both halves start on a host that has CUDA (for debugging the backend itself, never for training).
FORCE_ENV = "NEMO_GYM_BROWSER_CPU_BACKEND_FORCE"
# Where the rollout server reads its thread count: rollout.engine_kwargs is a free-form dict per backend.
THREADS_KEY = "num_threads"
# The rollout's dtype names and verl's FSDP mixed-precision names for the same dtypes.
_FSDP_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def cpu_env(*, num_threads: int = 1) -> dict[str, str]:
    """The environment variables ``main_ppo`` needs on CPU (merge them over ``os.environ`` before Ray starts)."""
    threads = str(int(num_threads))
    return {
        "VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE,
        "VERL_PLATFORM": PLATFORM_NAME,
        "VERL_ENGINE_DEVICE": "cuda",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def cpu_overrides(*, num_threads: int = 1, logical_cpus: int = 16, dtype: str = "float32") -> list[str]:
    """The hydra overrides that put ``main_ppo`` on the ``cpu`` platform with the ``hfcpu`` rollout.

    ``num_threads`` is the rollout server's torch thread count (keep it at 1 on a 2-core machine that also runs a
    browser); ``logical_cpus`` is what Ray believes it has, so that verl's actors (one CPU each) can be placed;
    ``dtype`` is the rollout's and the actor's and reference's compute dtype (``float32``, ``bfloat16``,
    ``float16``): the same on both sides, so that ``rollout_log_probs`` and the actor's ``old_log_probs`` agree.
    """
    if dtype not in _FSDP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_FSDP_DTYPES)}, got {dtype!r}")
    return [
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "+ray_kwargs.ray_init.num_gpus=1",
        f"ray_kwargs.ray_init.num_cpus={int(logical_cpus)}",
        "+ray_kwargs.ray_init._node_ip_address=127.0.0.1",
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.dtype={dtype}",
        f"+actor_rollout_ref.rollout.engine_kwargs.{ROLLOUT_NAME}.{THREADS_KEY}={int(num_threads)}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={_FSDP_DTYPES[dtype]}",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype={_FSDP_DTYPES[dtype]}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
