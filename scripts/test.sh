#!/usr/bin/env bash
# Sets everything up and runs both test tiers: offline (real verl, fakes) and integration (real nemo-gym server).
#
#   bash scripts/test.sh                 # everything, as CI runs it
#   bash scripts/test.sh --offline-only  # skip the real environment (no Chromium, no nemo-gym venv)
#   bash scripts/test.sh -- -k judge     # extra arguments after -- go to both pytest runs
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
offline_only=0
pytest_args=()
while (($#)); do
    case "$1" in
        --offline-only) offline_only=1 ;;
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "test.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

started=$SECONDS
bash scripts/setup.sh
if ((offline_only == 0)); then
    bash scripts/setup_environment.sh
    bash scripts/setup_slurm.sh
fi
PY="$ROOT/.venv/bin/python"

echo "== lint"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
shopt -s nullglob
shell_files=(scripts/*.sh ./*.sh .ci/run)
shopt -u nullglob
if ! command -v shellcheck >/dev/null; then
    echo "test.sh: installing shellcheck (Debian package)"
    apt-get install -y -q --no-install-recommends shellcheck >/dev/null
fi
shellcheck "${shell_files[@]}"

echo "== offline tier"
t0=$SECONDS
"$PY" -m pytest -m "not integration" -q "${pytest_args[@]}"
echo "offline tier: $((SECONDS - t0))s"

if ((offline_only == 0)); then
    echo "== integration tier"
    t0=$SECONDS
    "$PY" -m pytest -m integration -q "${pytest_args[@]}"
    echo "integration tier: $((SECONDS - t0))s"
fi
echo "all tests passed in $((SECONDS - started))s"
