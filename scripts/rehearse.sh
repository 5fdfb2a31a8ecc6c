#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the local rehearsal (no GPU, a few minutes):
# a real nemo-gym 0.7.0 interactive_browser with headless Chromium on 127.0.0.1, one smoke episode, GRPO groups
# rolled out through BrowserToolAgentLoop with injected infrastructure failures, and the advantages the recipe
# gives each sample next to what stock GRPO would have given it. Everything it starts is stopped at the end.
# With --train it then trains a real policy: verl's main_ppo with this recipe on the CPU backend, the shipped tiny
# deal policy (local/deal_policy) on the Corner Shop's deal tasks, 85 % of browser calls failing (the fault proxy
# loses the session), one line per step, held-back success before and after.
#
#   bash scripts/rehearse.sh             # set up (once), then rehearse
#   bash scripts/rehearse.sh --train     # the same, then a short real training run (several more minutes)
#   bash scripts/rehearse.sh --verbose   # other arguments go to rehearsal.py (see python rehearsal.py --help)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
train=0
args=()
for arg in "$@"; do
    if [[ "${arg}" == --train ]]; then train=1; else args+=("${arg}"); fi
done
bash scripts/setup.sh
bash scripts/setup_environment.sh
"$ROOT/.venv/bin/python" rehearsal.py "${args[@]}"
if ((train)); then
    echo
    echo "== a real training run: verl main_ppo, BrowserToolAgentLoop, grpo_env_aware, the CPU backend in place of vLLM"
    exec "$ROOT/.venv/bin/python" -m nemo_gym_browser.local.training_run --workdir "$ROOT/.cache/rehearsal-train" \
        --suite deal --steps 8 --prompts-per-step 4 --group-size 8 --lr 3e-4 --fault-rate 0.85 \
        --fault-at browser-call --fault-kind lose_session --test-freq 8 --val-tasks 48
fi
