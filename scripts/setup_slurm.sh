#!/usr/bin/env bash
# Install and start the tests' single-node Slurm: Debian's slurm-wlm, munge, and slurmdbd with
# MariaDB for accounting (sacct, which submitit polls). Run as root. Idempotent: installs only
# what is missing and starts only the daemons that are down. Everything it needs is in this
# repository: scripts/slurm/ (config templates, start.sh, stop.sh).
#   bash scripts/setup_slurm.sh          # install + start
#   bash scripts/slurm/stop.sh           # stop every daemon it started
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "[slurm] error: run as root (it installs packages and starts daemons)" >&2; exit 1; }
missing=0
for cmd in slurmctld slurmd sinfo sbatch munged slurmdbd mariadbd; do
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing=1
done
if [ "$missing" = 1 ]; then
  command -v apt-get >/dev/null 2>&1 || { echo "[slurm] error: Slurm is not installed and there is no apt-get (Debian/Ubuntu) to install it" >&2; exit 1; }
  echo "[slurm] installing slurm-wlm, munge, slurmdbd, mariadb-server (log: /tmp/scalerl-slurm-apt.log)"
  log=/tmp/scalerl-slurm-apt.log
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      slurm-wlm slurmctld slurmd slurm-client munge slurmdbd mariadb-server mariadb-client; } >"$log" 2>&1 \
    || { tail -n 30 "$log" >&2; echo "[slurm] error: apt-get failed (log: $log)" >&2; exit 1; }
fi
exec bash scripts/slurm/start.sh
