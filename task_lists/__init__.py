"""Task lists to rows: reading WebVoyager-style task files and writing the rows NeMo Gym and the dataset read.

Owns the task spec and its checks, the row each task becomes (prompt, tool schema, ``verifier_metadata``), and the
named dates a task's wording may hold.

Imports: only this folder, ``gym_contract`` and the root's ``settings``. Importing the folder imports nothing.
"""
