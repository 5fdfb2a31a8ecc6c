#!/usr/bin/env bash
# Installs Debian's Slurm (slurmctld, slurmd, the client commands) and MUNGE for the Slurm tests, and what the
# two-host tests build their hosts with: iproute2 (network namespaces, veth), util-linux (unshare, nsenter) and
# iptables (a firewall between the hosts). Idempotent: a second run only checks. Starts no daemon: the tests start
# their own with a slurm.conf they write to a temporary folder (on loopback, or inside network namespaces they make),
# and stop them by PID.
#
#   bash scripts/setup_slurm.sh
#
# Debian's maintainer scripts would start munged/slurmctld/slurmd through invoke-rc.d on a machine without systemd;
# a temporary policy-rc.d (exit 101 = "action forbidden") keeps them from doing so during the install.
set -euo pipefail

readonly PACKAGES=(slurmctld slurmd slurm-client munge iproute2 util-linux iptables)
# Waits for another apt/dpkg run (a teammate's or CI's) instead of failing on the lock.
readonly APT_LOCK_TIMEOUT_S=600

log() { printf '[setup_slurm] %s\n' "$*"; }

started=${SECONDS}
# `sbatch --version` needs a slurm.conf (without one it asks DNS for a controller), so ask dpkg instead.
versions() { dpkg-query -W -f='${Package} ${Version}, ' "${PACKAGES[@]}" 2>/dev/null | sed 's/, $//'; }
have_all() {
    command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v munged >/dev/null && command -v mungekey >/dev/null && command -v ip >/dev/null &&
        command -v unshare >/dev/null && command -v nsenter >/dev/null && command -v iptables >/dev/null
}
if have_all; then
    log "already installed: $(versions)"
    exit 0
fi
[[ "$(id -u)" -eq 0 ]] || { log "ERROR: needs root (apt-get install ${PACKAGES[*]})" >&2; exit 1; }

policy=/usr/sbin/policy-rc.d
created_policy=0
remove_policy() { if ((created_policy)); then rm -f "${policy}"; fi; }
trap remove_policy EXIT
if [[ ! -e "${policy}" ]]; then
    printf '#!/bin/sh\nexit 101\n' >"${policy}"
    chmod 755 "${policy}"
    created_policy=1
fi

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="${APT_LOCK_TIMEOUT_S}" install -y -q \
        --no-install-recommends "${PACKAGES[@]}"
}
log "apt-get install ${PACKAGES[*]}"
if ! apt_install; then
    log "install failed; refreshing the package lists once and retrying"
    apt-get -o DPkg::Lock::Timeout="${APT_LOCK_TIMEOUT_S}" update -q
    apt_install
fi
have_all || { log "ERROR: the install finished but a Slurm, MUNGE or network command is missing" >&2; exit 1; }
log "installed $(versions) in $((SECONDS - started)) s"
