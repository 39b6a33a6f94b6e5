#!/usr/bin/env bash
# Stop the daemons of scalerl-zoo's test Slurm (scripts/slurm/start.sh), each by its pid file,
# and wait until they have exited. Jobs still running are killed with slurmd. Run as root.
#   bash scripts/slurm/stop.sh
set -uo pipefail
say() { echo "[slurm] $*"; }
# stop NAME PIDFILE: SIGTERM the daemon, then wait up to 30 s for it to exit (SIGKILL after that)
stop() {
  local name=$1 pidfile=$2 pid=""
  [ -s "$pidfile" ] && pid="$(cat "$pidfile")"
  # no pid file, or a stale one: the running daemon of that exact name, if any
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then pid="$(pidof "$name" 2>/dev/null || true)"; fi
  if [ -z "$pid" ]; then say "$name is not running"; return; fi
  say "stopping $name (pid $pid)"
  kill $pid 2>/dev/null || true
  for _ in $(seq 150); do kill -0 $pid 2>/dev/null || return 0; sleep 0.2; done
  say "$name did not exit within 30 s: SIGKILL"
  kill -9 $pid 2>/dev/null || true
}
[ "$(id -u)" = 0 ] || { echo "[slurm] error: run as root" >&2; exit 1; }
stop slurmd /run/slurm/slurmd.pid
stop slurmctld /run/slurm/slurmctld.pid
stop slurmdbd /run/slurm/slurmdbd.pid
stop mariadbd /run/mysqld/mysqld.pid
stop munged /run/munge/munged.pid
