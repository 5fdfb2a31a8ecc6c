"""What runs inside verl's trainers: the wrappers the root's ``patches`` installs and what they read.

Owns the wrappers' behaviour (flagged batches to ``grpo_env_aware``, the ``env/*`` step metrics), the names of the
verl functions they wrap, the warning when exclusions rise while the environment is healthy, and the run's ledger of
rollouts the drop switch left out.

Imports: only this folder and the folders below it (``gym_contract``, ``task_lists``, ``agent_attempt``), the root's
``settings``, and, lazily, the root's estimator ``group_stats`` (an upstream-layout file). Importing the folder
imports nothing.
"""
