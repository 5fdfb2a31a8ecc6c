"""The environment side: the HTTP contract with NeMo Gym's ``interactive_browser`` server and what crosses it.

Owns the typed client and what the server's answers mean, where sessions go (placement) and the run's named actors,
what a row promises the server, the tool names and the grammar of a call, session ids, the failure vocabulary, and
the checks at the boundary (URL safety, credentials kept out of logs, the one rule for cutting text).

Imports: only this folder, and the root's ``settings`` (the configuration every layer reads). Importing the folder
imports nothing.
"""
