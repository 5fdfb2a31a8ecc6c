# shellcheck shell=bash
# Sourced by the set-up scripts: choose the interpreter a virtual environment is built from.
#
#   find_python VARIABLE "3.11 3.12" CANDIDATE...
#
# Prints the path of the interpreter to use and returns 0, or writes one line naming what to install to stderr and
# returns 1.
# When the variable VARIABLE is set (PYTHON, GYM_PYTHON), its value is the only candidate and must run and report one
# of the versions; otherwise the first CANDIDATE (a command name or path) that runs and reports one of them wins.
# Each candidate is run, not just looked up: a pyenv shim for a version that is not installed is found on PATH but
# fails to start.

# python_version COMMAND: "3.11" for a Python 3.11 that starts, nothing otherwise.
python_version() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

find_python() {
    local variable="$1" versions="$2" candidate version state tried="" seen=()
    shift 2
    local candidates=("$@")
    if [[ -n "${!variable:-}" ]]; then candidates=("${!variable}"); fi
    for candidate in "${candidates[@]}"; do
        version="$(python_version "${candidate}")"
        if [[ -n "${version}" && " ${versions} " == *" ${version} "* ]]; then
            command -v "${candidate}"
            return 0
        fi
        if [[ -n "${version}" ]]; then
            state="${version}"
        elif command -v "${candidate}" >/dev/null; then
            state="does not start"
        else
            state="not found"
        fi
        seen+=("${candidate} (${state})")
    done
    printf -v tried '%s, ' "${seen[@]}"
    tried="${tried%, }"
    if [[ -n "${!variable:-}" ]]; then
        echo "${0##*/}: ERROR: ${variable}=${!variable} is not a Python ${versions// / or }: ${tried}; set ${variable} to one that is" >&2
    else
        echo "${0##*/}: ERROR: no Python ${versions// / or } found (tried ${tried}): install one (Debian 12: apt-get install python${versions%% *}-venv; elsewhere pyenv, conda or uv python install ${versions%% *}) or set ${variable}=/path/to/python3.x" >&2
    fi
    return 1
}
