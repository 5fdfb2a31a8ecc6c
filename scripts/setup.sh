#!/usr/bin/env bash
# Creates .venv with the recipe, verl 0.9.1 and the test tools. Idempotent: a second run only checks.
#
#   bash scripts/setup.sh            # CPU machine: installs torch==2.13.0 (CPU build) first
#   TORCH_SPEC=skip bash scripts/setup.sh   # keep the torch already in the venv (GPU nodes)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEMO_GYM_BROWSER_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
# Installed before verl so that pip does not resolve a CUDA build of several GB through it.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

started=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

stamp="$VENV/.nemo-gym-browser-setup"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$VENV/bin/python" -c "import verl, nemo_gym_browser" 2>/dev/null; then
    echo "setup: $VENV is up to date"
    exit 0
fi

if [[ "$TORCH_SPEC" != "skip" ]]; then
    echo "setup: installing $TORCH_SPEC"
    "${PIP[@]}" install -q "$TORCH_SPEC"
fi
echo "setup: installing the recipe (editable) with verl[verl-core]==0.9.1, the test and benchmark tools"
"${PIP[@]}" install -q -c "$ROOT/constraints.txt" -e "${ROOT}[test,bench]"

"$VENV/bin/python" - "$ROOT/REQUIRED_VERL.txt" <<'PY'
import sys
import verl

required = dict(line.strip().split("=", 1) for line in open(sys.argv[1]) if "=" in line)["VERL_VERSION"]
if verl.__version__ != required:
    sys.exit(f"setup: verl {verl.__version__} is installed but REQUIRED_VERL.txt names {required}")
print(f"setup: verl {verl.__version__} matches REQUIRED_VERL.txt")
PY
echo "$want" > "$stamp"
echo "setup: done in $((SECONDS - started))s"
