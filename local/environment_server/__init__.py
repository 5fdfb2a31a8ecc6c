"""An in-process ``interactive_browser`` server: NeMo Gym 0.7.0's wire contract over a page model, no Chromium.

:class:`~.server.InProcessEnvironmentServer` serves a :class:`~.site_model.Site` (the Corner Shop's pages, or the
real server's bundled site) on 127.0.0.1 with the sessions, cookies, 422s and grading a client of the real server
sees, and injects faults on demand. The warm start and the policy evaluation play against it; tests and benchmarks
use it as the real server's stand-in.
"""
