"""One attempt at a task, and the verl pieces the agent loop plugs in.

Owns the episode (the live session, its clocks, its typed steps), the step-wise samples' prompts, the verl
``BaseTool`` and its tool-call parser, cancelling a generation cut by a deadline, the per-sample flags and the fields
every sample carries, and the judge's prompt.

Imports: only this folder, ``gym_contract``, ``task_lists`` and the root's ``settings``. Importing the folder imports
nothing.
"""
