#!/usr/bin/env bash
# Creates .venv with the recipe, verl 0.9.1 on torch 2.13.0 and the test tools: the tests' and rehearsals' venv, on
# CPU. Not a training venv: a cluster's Python needs CUDA torch and vLLM (README, "Run it on a Slurm cluster").
# Idempotent: a second run only checks.
#
#   bash scripts/setup.sh                                 # torch==2.13.0 from pip's configured indexes
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh   # the CPU build (182 MiB) from
#                                                         # PyTorch's CPU index, or your site's mirror of it
#   PYTHON=/usr/bin/python3.12 bash scripts/setup.sh      # build the venv from this interpreter
#   TORCH_SPEC=skip bash scripts/setup.sh                 # keep the torch already in the venv
#
# What torch==2.13.0 brings depends on where pip looks: PyPI's Linux x86_64 wheel is the CUDA 13 build, and with its
# NVIDIA libraries pip downloads 29 files, 2.55 GiB (measured with `pip install --dry-run --report` on Python 3.11;
# a whole set-up that way took 364 s here and left a 5.9 GB .venv); the CPU build is one 182 MiB wheel. Set TORCH_INDEX_URL for the CPU build on a machine whose pip reaches only PyPI.
# PYTHON: a Python 3.11 or 3.12 (what verl 0.9.1 supports and the tests run on); empty: python3.11, python3.12, then
# python3, the first that runs and is one of them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEMO_GYM_BROWSER_VENV:-$ROOT/.venv}"
# Installed before verl so that pip does not resolve torch through it (any build a range admits, CUDA by default).
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
# shellcheck source=scripts/find_python.sh
source "$ROOT/scripts/find_python.sh"

started=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
    PYTHON="$(find_python PYTHON "3.11 3.12" python3.11 python3.12 python3)" || exit 1
    echo "setup: creating $VENV with $("$PYTHON" --version) ($PYTHON)"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

stamp="$VENV/.nemo-gym-browser-setup"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1) $TORCH_SPEC $TORCH_INDEX_URL"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$VENV/bin/python" -c "import verl, nemo_gym_browser" 2>/dev/null; then
    echo "setup: $VENV is up to date"
    exit 0
fi

if [[ "$TORCH_SPEC" != "skip" ]]; then
    torch_index=()
    if [[ -n "$TORCH_INDEX_URL" ]]; then torch_index=(--index-url "$TORCH_INDEX_URL"); fi
    echo "setup: installing $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
    "${PIP[@]}" install -q "${torch_index[@]}" "$TORCH_SPEC"
    "$VENV/bin/python" -c 'import torch; print("setup: torch", torch.__version__, "CUDA", torch.version.cuda or "none")'
fi
echo "setup: installing the recipe (editable) with verl[verl-core]==0.9.1, the test and benchmark tools, MiniWoB++'s pages"
"${PIP[@]}" install -q -c "$ROOT/constraints.txt" -e "${ROOT}[test,bench,miniwob]"

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
