#!/usr/bin/env bash
# Install and start a real single-node Slurm (Debian slurm-wlm + munge + slurmdbd/MariaDB
# for sacct) using shared/slurm/start_slurm.sh. Run as root. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
SLURM_DIR=${SCALERL_SLURM_DIR:-}
for d in "$SLURM_DIR" ../shared/slurm shared/slurm; do
  if [ -n "$d" ] && [ -f "$d/start_slurm.sh" ]; then SLURM_DIR=$d; break; fi
done
if [ ! -f "$SLURM_DIR/start_slurm.sh" ]; then echo "[slurm] start_slurm.sh not found (looked in ../shared/slurm, shared/slurm)"; exit 1; fi
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmdbd >/dev/null 2>&1; then
  echo "[slurm] installing slurm-wlm, munge, slurmdbd, mariadb-server"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmctld slurmd munge slurmdbd mariadb-server >/dev/null
fi
# A MariaDB that was killed leaves its socket behind; start_slurm.sh would then query too early.
if ! pidof mariadbd >/dev/null 2>&1; then rm -f /run/mysqld/mysqld.sock; fi
# setsid: start_slurm.sh starts MariaDB with `nohup ... &`, which would otherwise die with the
# calling shell's session (slurmctld, slurmd and slurmdbd daemonize themselves).
setsid -w bash "$SLURM_DIR/start_slurm.sh"
