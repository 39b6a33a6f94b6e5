#!/usr/bin/env bash
# Start scalerl-zoo's single-node test Slurm: munge, MariaDB + slurmdbd (accounting, for
# sacct), slurmctld and slurmd, all on this machine, with one partition `debug`. Run as root,
# after the packages are installed (scripts/setup_slurm.sh installs them and calls this).
# Idempotent: writes the configs when they change and starts only the daemons that are down.
#
#   bash scripts/slurm/start.sh
#   SCALERL_SLURM_ACCOUNTING=none bash scripts/slurm/start.sh   # no slurmdbd/MariaDB (no sacct)
#   bash scripts/slurm/start.sh --print-config   # print the slurm.conf it would write; start nothing
#   SCALERL_SLURM_FRESH=1 bash scripts/slurm/start.sh  # a controller it starts cancels saved jobs
#
# slurmctld keeps its jobs in /var/spool/slurmctld and, started again after a stop or a reboot,
# brings them back and runs them. With SCALERL_SLURM_FRESH=1 (.ci/run sets it) the jobs that a
# controller this script starts brings back are cancelled before the node's slurmd starts, so a
# CI run never shares the one node with jobs left from before. (Not `slurmctld -c`: that also
# resets the job ids, which accounting, and so sacct and submitit, would then see twice.) A
# controller that is already running is left as it is either way; its queue is printed.
#
# Logs: /var/log/slurm/{slurmctld,slurmd,slurmdbd,mariadb}.log. Stop: scripts/slurm/stop.sh.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MARK="# scalerl-zoo test cluster"
say() { echo "[slurm] $*"; }
die() { echo "[slurm] error: $*" >&2; exit 1; }

PRINT_CONFIG=0
case "${1:-}" in
  --print-config) PRINT_CONFIG=1 ;;
  "") ;;
  *) die "unknown argument '$1' (usage: start.sh [--print-config])" ;;
esac
ACCOUNTING=${SCALERL_SLURM_ACCOUNTING:-dbd}
FRESH=${SCALERL_SLURM_FRESH:-0}
case "$FRESH" in 0|1) ;; *) die "SCALERL_SLURM_FRESH must be 0 or 1, not '$FRESH'" ;; esac
case "$ACCOUNTING" in dbd|none) ;; *) die "SCALERL_SLURM_ACCOUNTING must be dbd or none, not '$ACCOUNTING'" ;; esac

HOST="$(hostname -s)"
CPUS="$(nproc)"
MEMORY_MB=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 9 / 10 / 1024 ))
# slurm.conf from the template: this machine's name, CPUs and memory, and the accounting lines
render_slurm_conf() {
  local jobacct acct
  if [ "$ACCOUNTING" = dbd ]; then
    jobacct='JobAcctGatherType=jobacct_gather/linux\nJobAcctGatherFrequency=30'
    acct='AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\nAccountingStoragePort=6819'
  else
    jobacct='JobAcctGatherType=jobacct_gather/none'
    acct='AccountingStorageType=accounting_storage/none'
  fi
  sed -e "s/@HOST@/$HOST/g" -e "s/@CPUS@/$CPUS/g" -e "s/@MEMORY_MB@/$MEMORY_MB/g" \
      -e "s#^@JOBACCT@\$#$jobacct#" -e "s#^@ACCOUNTING@\$#$acct#" "$HERE/slurm.conf.template"
}
if [ "$PRINT_CONFIG" = 1 ]; then render_slurm_conf; exit 0; fi

[ "$(id -u)" = 0 ] || die "run as root"
for cmd in munged slurmctld slurmd sinfo scontrol; do
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || die "$cmd is not installed (bash scripts/setup_slurm.sh installs it)"
done
if [ "$ACCOUNTING" = dbd ]; then
  for cmd in slurmdbd mariadbd mariadb sacctmgr; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || die "$cmd is not installed (bash scripts/setup_slurm.sh installs it)"
  done
fi

running() { pidof "$1" >/dev/null 2>&1; }
# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds
wait_for() {
  local secs=$1 what=$2; shift 2
  local end=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die "$what did not come up within ${secs} s (logs: /var/log/slurm/)"
    sleep 0.2
  done
}
# start_daemon [--foreground] NAME COMMAND...: start a daemon unless one is running, in its own
# session and detached from our stdio (a caller reading our output through a pipe must not wait
# on it, and the daemon must outlive the caller's session). COMMAND daemonizes itself, or with
# --foreground, stays in the foreground and is put in the background here.
start_daemon() {
  local fg=0; if [ "$1" = --foreground ]; then fg=1; shift; fi
  local name=$1; shift
  if running "$name"; then say "$name is running (pid $(pidof "$name"))"; return; fi
  say "starting $name"
  local log="/var/log/slurm/$name.start.log"
  if [ "$fg" = 1 ]; then
    setsid "$@" </dev/null >>"$log" 2>&1 &
  else
    setsid "$@" </dev/null >>"$log" 2>&1 || die "$name failed to start: $(tail -n 5 "$log")"
  fi
}

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm

# 0) slurm.conf. A configuration that this script did not write belongs to someone else:
#    if that Slurm answers, use it as it is; otherwise refuse rather than overwrite it.
CONF=/etc/slurm/slurm.conf
if [ -s "$CONF" ] && ! grep -q "^$MARK" "$CONF"; then
  if sinfo -h >/dev/null 2>&1; then say "a Slurm not set up by this script is running ($CONF): using it as it is"; sinfo; exit 0; fi
  [ "${SCALERL_SLURM_OVERWRITE:-0}" = 1 ] || die "$CONF was not written by this script; set SCALERL_SLURM_OVERWRITE=1 to replace it"
fi
NEW_CONF="$(mktemp)"
trap 'rm -f "$NEW_CONF"' EXIT
render_slurm_conf >"$NEW_CONF"
CONF_CHANGED=0
if ! cmp -s "$NEW_CONF" "$CONF"; then
  install -m 644 "$NEW_CONF" "$CONF"; CONF_CHANGED=1
  say "wrote $CONF (node $HOST, $CPUS CPUs, $MEMORY_MB MB, accounting: $ACCOUNTING)"
fi

# 1) munge: authentication between the daemons and the commands.
mkdir -p /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null 2>&1; then mungekey --create --keyfile=/etc/munge/munge.key
  else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
fi
chown munge:munge /etc/munge/munge.key /run/munge
chmod 400 /etc/munge/munge.key
chmod 755 /run/munge
for d in /var/lib/munge /var/log/munge; do [ -d "$d" ] && chown munge:munge "$d"; done
if ! running munged; then rm -f /run/munge/munge.socket.2 /run/munge/munged.pid; fi
start_daemon munged runuser -u munge -- /usr/sbin/munged
wait_for 10 munged bash -c 'munge -n | unmunge'

# 2) accounting: MariaDB, its database and user, slurmdbd, the cluster's record.
if [ "$ACCOUNTING" = dbd ]; then
  mkdir -p /run/mysqld && chown mysql:root /run/mysqld
  if [ ! -d /var/lib/mysql/mysql ]; then
    say "initialising MariaDB's data directory"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/var/log/slurm/mariadb-install.log 2>&1 \
      || die "mariadb-install-db failed (see /var/log/slurm/mariadb-install.log)"
  fi
  # A MariaDB that was killed leaves its socket behind, which would look like a running one.
  if ! running mariadbd; then rm -f /run/mysqld/mysqld.sock /run/mysqld/mysqld.pid; fi
  start_daemon --foreground mariadbd /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql \
    --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid --bind-address=127.0.0.1 \
    --log-error=/var/log/slurm/mariadb.log
  wait_for 60 mariadbd mariadb -u root -e 'SELECT 1'

  DBD_CONF=/etc/slurm/slurmdbd.conf
  PASS=""
  if [ -s "$DBD_CONF" ] && grep -q "^$MARK" "$DBD_CONF"; then PASS="$(sed -n 's/^StoragePass=//p' "$DBD_CONF")"; fi
  [ -n "$PASS" ] || PASS="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
  mariadb -u root -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$PASS';
    ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  sed -e "s/@DB_PASSWORD@/$PASS/" "$HERE/slurmdbd.conf.template" >"$NEW_CONF"
  if ! cmp -s "$NEW_CONF" "$DBD_CONF"; then install -m 600 -o root -g root "$NEW_CONF" "$DBD_CONF"; fi

  start_daemon slurmdbd /usr/sbin/slurmdbd
  wait_for 30 slurmdbd sacctmgr -n show cluster
  sacctmgr -n -P show cluster format=cluster | grep -qx local || sacctmgr -i add cluster local >/dev/null
fi

# 3) the controller and the node's daemon (both daemonize; they read slurm.conf).
if [ "$CONF_CHANGED" = 1 ] && running slurmctld; then
  say "slurm.conf changed: reconfiguring the running daemons"
  scontrol reconfigure || true
fi
if [ "$FRESH" = 1 ] && ! running slurmctld; then
  start_daemon slurmctld /usr/sbin/slurmctld
  wait_for 30 slurmctld squeue -h
  saved="$(squeue -h -o '%F %j %T' | sort -u)"
  if [ -n "$saved" ]; then
    say "SCALERL_SLURM_FRESH=1: cancelling the $(printf '%s\n' "$saved" | wc -l) job(s) an earlier controller saved:"
    printf '%s\n' "$saved" | head -n 10 | sed 's/^/  /'
    printf '%s\n' "$saved" | cut -d' ' -f1 | xargs scancel
  fi
else
  start_daemon slurmctld /usr/sbin/slurmctld
fi
start_daemon slurmd /usr/sbin/slurmd
node_up() { sinfo -h -n "$HOST" -o '%T' | grep -qE '^(idle|mixed|allocated|completing)'; }
end=$(( $(date +%s) + 60 ))
until node_up 2>/dev/null; do
  # a node left down or drained (e.g. after an unclean stop) is put back into service
  scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
  [ "$(date +%s)" -lt "$end" ] || die "node $HOST is not up after 60 s: $(sinfo -h -N -o '%N %T %E' 2>&1) (logs: /var/log/slurm/)"
  sleep 0.5
done
sinfo
queued="$(squeue -h -o '%i %j %T %r' 2>/dev/null || true)"
if [ -n "$queued" ]; then say "jobs in the queue ($(printf '%s\n' "$queued" | wc -l)):"; printf '%s\n' "$queued" | head -n 10 | sed 's/^/  /'; fi
say "up: munged $(pidof munged)$( [ "$ACCOUNTING" = dbd ] && echo ", mariadbd $(pidof mariadbd), slurmdbd $(pidof slurmdbd)"), slurmctld $(pidof slurmctld), slurmd $(pidof slurmd)"
