#!/usr/bin/env bash
# Build the real local environment: NeMo Gym 0.7.0's `interactive_browser` resources server in its own
# virtual environment (.venv-gym at the repository root), driving Debian's headless Chromium.
#
#   bash scripts/setup_environment.sh            # idempotent; a second run only checks the marker
#   GYM_VENV=/path bash scripts/setup_environment.sh
#   GYM_PYTHON=/usr/bin/python3.12 bash scripts/setup_environment.sh   # build the venv from this interpreter
#   FORCE=1 bash scripts/setup_environment.sh    # rebuild the virtual environment from scratch
#
# What it does, each part timed:
#   1. Chromium: `apt-get install chromium` when /usr/bin/chromium is missing (needs root).
#   2. A virtual environment from GYM_PYTHON, or else the first of python3.11, python3.12, python3.13, python3 that
#      runs and is one of those versions (nemo-gym declares Requires-Python >=3.13.14; its code runs on 3.11, the
#      version the tests use). The venv's python links to that interpreter: a venv on a shared file system works on
#      every node only where the interpreter exists at the same path (else build it on each node).
#   3. nemo-gym 0.7.0's runtime dependencies (its wheel's Requires-Dist lines without `extra ==`), then the
#      interactive_browser server's own requirements (Playwright), then the nemo-gym wheel itself with
#      --no-deps --ignore-requires-python.
#   4. A PLAYWRIGHT_BROWSERS_PATH folder of links to Debian's Chromium, for the `local_playwright` backend
#      (Playwright cannot download its own browser here).
#   5. An import check, then the marker file that makes the next run return at once.
set -euo pipefail

readonly NEMO_GYM_VERSION="0.7.0"
# The server's requirements.txt pins this; 1.65 also works, but the pin keeps the driver matched to its tests.
readonly PLAYWRIGHT_FALLBACK_SPEC="playwright>=1.62,<1.63"
# Bump when the steps below change, so existing environments are rebuilt instead of trusted.
readonly SETUP_REVISION="1"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GYM_VENV="${GYM_VENV:-${REPO_ROOT}/.venv-gym}"
GYM_PYTHON="${GYM_PYTHON:-}"
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
FORCE="${FORCE:-0}"
MARKER="${GYM_VENV}/.setup-complete"
BROWSERS_DIR="${GYM_VENV}/playwright-browsers"
# shellcheck source=scripts/find_python.sh
source "${REPO_ROOT}/scripts/find_python.sh"
if [[ -z "${GYM_PYTHON}" && "${FORCE}" != "1" && -n "$(python_version "${GYM_VENV}/bin/python")" ]]; then
    GYM_PYTHON="${GYM_VENV}/bin/python"  # an existing venv keeps the interpreter it was built from
else
    GYM_PYTHON="$(find_python GYM_PYTHON "3.11 3.12 3.13" python3.11 python3.12 python3.13 python3)" || exit 1
fi
EXPECTED_MARKER="nemo-gym==${NEMO_GYM_VERSION} python=$(python_version "${GYM_PYTHON}") setup-revision=${SETUP_REVISION}"

SCRIPT_START=${SECONDS}
STEP_START=${SECONDS}
WORK_DIR=""

log() { printf '[setup_environment] %s\n' "$*"; }
die() {
    printf '[setup_environment] ERROR: %s\n' "$*" >&2
    exit 1
}
step() {
    STEP_START=${SECONDS}
    log "==> $*"
}
step_done() { log "    done in $((SECONDS - STEP_START)) s"; }
cleanup() { if [[ -n "${WORK_DIR}" ]]; then rm -rf "${WORK_DIR}"; fi; }
trap cleanup EXIT

as_root() {
    if [[ "$(id -u)" -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root to run: $* (run this script as root or install sudo)"
    fi
}

apt_install() {
    log "    apt-get install -y --no-install-recommends $*"
    if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"; then
        log "    install failed; refreshing the package lists once and retrying"
        as_root apt-get update
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
    fi
}

marker_is_current() {
    [[ -f "${MARKER}" ]] && [[ "$(cat "${MARKER}")" == "${EXPECTED_MARKER}" ]] &&
        [[ -x "${GYM_VENV}/bin/python" ]] && [[ -x "${CHROMIUM}" ]]
}

if [[ "${FORCE}" != "1" ]] && marker_is_current; then
    log "already complete (${MARKER}: ${EXPECTED_MARKER}); FORCE=1 rebuilds"
    exit 0
fi

# ---------------------------------------------------------------- 1. Chromium
step "Chromium (${CHROMIUM})"
if [[ -x "${CHROMIUM}" ]]; then
    log "    present: $("${CHROMIUM}" --version 2>/dev/null | head -n 1)"
else
    command -v apt-get >/dev/null 2>&1 || die "${CHROMIUM} is missing and apt-get is not available; install Chromium"
    apt_install chromium
    [[ -x "${CHROMIUM}" ]] || die "apt-get finished but ${CHROMIUM} is still missing"
fi
step_done

# ---------------------------------------------------------------- 2. Python virtual environment
step "virtual environment ${GYM_VENV} (${GYM_PYTHON})"
if [[ "${FORCE}" == "1" && -d "${GYM_VENV}" ]]; then
    log "    FORCE=1: removing the old environment"
    rm -rf "${GYM_VENV}"
fi
rm -f "${MARKER}"
if [[ ! -x "${GYM_VENV}/bin/python" ]]; then
    "${GYM_PYTHON}" -m venv "${GYM_VENV}"
fi
VENV_PY="${GYM_VENV}/bin/python"
log "    $("${VENV_PY}" --version)"
step_done

# ---------------------------------------------------------------- 3. nemo-gym, its dependencies, Playwright
step "nemo-gym ${NEMO_GYM_VERSION} and its runtime dependencies"
WORK_DIR="$(mktemp -d)"
pip_quiet() { "${VENV_PY}" -m pip --disable-pip-version-check "$@"; }
# The wheel declares Requires-Python >=3.13.14, so pip must be told to fetch it anyway.
pip_quiet download --quiet --no-deps --ignore-requires-python "nemo-gym==${NEMO_GYM_VERSION}" -d "${WORK_DIR}"
WHEEL="$(find "${WORK_DIR}" -maxdepth 1 -name "nemo_gym-${NEMO_GYM_VERSION}-*.whl" | head -n 1)"
[[ -n "${WHEEL}" ]] || die "pip download produced no nemo_gym ${NEMO_GYM_VERSION} wheel"
# Runtime requirements = Requires-Dist lines without an extra; plus the server folder's own requirements
# (skipping its editable `-e nemo-gym[dev]` line, which is the wheel we install last).
"${VENV_PY}" - "${WHEEL}" "${WORK_DIR}/requirements.txt" "${PLAYWRIGHT_FALLBACK_SPEC}" <<'PY'
import sys
import zipfile

wheel, out_path, playwright_fallback = sys.argv[1:4]
with zipfile.ZipFile(wheel) as zf:
    names = zf.namelist()
    metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    server_reqs = zf.read("resources_servers/interactive_browser/requirements.txt").decode()
runtime = [
    line.split(":", 1)[1].strip()
    for line in metadata.splitlines()
    if line.startswith("Requires-Dist:") and "extra ==" not in line
]
server = [
    line.strip()
    for line in server_reqs.splitlines()
    if line.strip() and not line.strip().startswith(("#", "-e", "nemo-gym"))
]
if not any(req.lower().startswith("playwright") for req in server):
    server.append(playwright_fallback)
with open(out_path, "w") as fh:
    fh.write("\n".join(runtime + server) + "\n")
print(f"[setup_environment]     {len(runtime)} runtime requirements; server requirements: {', '.join(server)}")
PY
pip_quiet install --quiet -r "${WORK_DIR}/requirements.txt"
pip_quiet install --quiet --no-deps --ignore-requires-python "${WHEEL}"
log "    installed: $("${VENV_PY}" -m pip --disable-pip-version-check list 2>/dev/null |
    grep -iE '^(nemo-gym|playwright|fastapi|uvicorn) ' | tr -s ' ' | paste -sd ',' -)"
step_done

# ---------------------------------------------------------------- 4. Playwright browser folder -> Debian Chromium
step "Playwright browser folder ${BROWSERS_DIR} (links to Debian's Chromium)"
CHROMIUM_BINARY="$(readlink -f "${CHROMIUM}")"
# /usr/bin/chromium is Debian's shell wrapper; Playwright must exec the ELF binary it wraps.
if [[ -x /usr/lib/chromium/chromium ]]; then CHROMIUM_BINARY=/usr/lib/chromium/chromium; fi
rm -rf "${BROWSERS_DIR}"
"${VENV_PY}" - "${BROWSERS_DIR}" "${CHROMIUM_BINARY}" <<'PY'
import json
import os
import platform
import sys
from pathlib import Path

import playwright

browsers_dir, binary = Path(sys.argv[1]), sys.argv[2]
spec = json.loads((Path(playwright.__file__).parent / "driver/package/browsers.json").read_text())
revisions = {b["name"]: b["revision"] for b in spec["browsers"]}
arm = platform.machine() in ("aarch64", "arm64")
# Folder layout Playwright expects per browser (its registry's EXECUTABLE_PATHS for Linux).
layout = {
    "chromium": ("chrome-linux", "chrome") if arm else ("chrome-linux64", "chrome"),
    "chromium-headless-shell": ("chrome-linux", "headless_shell")
    if arm
    else ("chrome-headless-shell-linux64", "chrome-headless-shell"),
}
for name, parts in layout.items():
    folder = browsers_dir / f"{name.replace('-', '_')}-{revisions[name]}"
    link = folder.joinpath(*parts)
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(binary, link)
    (folder / "INSTALLATION_COMPLETE").touch()
    print(f"[setup_environment]     {link} -> {binary}")
PY
step_done

# ---------------------------------------------------------------- 5. check and mark complete
step "import check"
"${VENV_PY}" -c "import nemo_gym, playwright, fastapi, uvicorn, resources_servers.interactive_browser" ||
    die "the environment does not import; rerun with FORCE=1"
SERVER_DIR="$("${VENV_PY}" -c 'import os, resources_servers.interactive_browser as m; print(os.path.dirname(m.__file__))')"
[[ -f "${SERVER_DIR}/app.py" ]] || die "interactive_browser/app.py missing under ${SERVER_DIR}"
log "    server folder: ${SERVER_DIR}"
printf '%s' "${EXPECTED_MARKER}" >"${MARKER}"
step_done

log "environment size: $(du -sh "${GYM_VENV}" | cut -f1) (${GYM_VENV})"
log "complete in $((SECONDS - SCRIPT_START)) s"
