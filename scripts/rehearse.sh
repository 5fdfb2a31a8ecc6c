#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the local rehearsal (no GPU, a few minutes):
# a real nemo-gym 0.7.0 interactive_browser with headless Chromium on 127.0.0.1, one smoke episode, GRPO groups
# rolled out through BrowserToolAgentLoop with injected infrastructure failures, and the advantages the recipe
# gives each sample next to what stock GRPO would have given it. Everything it starts is stopped at the end.
#
#   bash scripts/rehearse.sh             # set up (once), then rehearse
#   bash scripts/rehearse.sh --verbose   # arguments go to rehearsal.py (see python rehearsal.py --help)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
bash scripts/setup_environment.sh
exec "$ROOT/.venv/bin/python" rehearsal.py "$@"
