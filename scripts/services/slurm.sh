#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, without systemd (Debian's slurm-wlm 22.05, munge, slurmdbd on
# MariaDB), for tests and for trying a cluster recipe before a real cluster. Run as root (slurmd starts jobs as
# their users). Configs, state, logs and the accounting database live in $QEXP_SERVICES_DIR; nothing is written to
# /etc/slurm: clients and daemons find the config through SLURM_CONF.
#   scripts/services/slurm.sh start   # prints `export SLURM_CONF=...`: run it in the shell that submits
#   scripts/services/slurm.sh stop | status
# Accounting (slurmdbd) is started too: Hydra's submitit launcher polls `sacct`, and without it a cancelled job is
# never seen to end.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
CONF_DIR=$D/slurm-etc
export SLURM_CONF=$CONF_DIR/slurm.conf
MYSQL_PORT=${QEXP_SLURM_DB_PORT:-33069}
NODE=$(hostname -s)

write_configs() {
  mkdir -p "$CONF_DIR" "$D/slurm-state" "$D/slurm-spool"
  local cpus mem
  # GNU nproc honours OMP_NUM_THREADS (the test workers set it to 1): the node's CPUs are the machine's
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  mem=$(( $(free -m | awk '/^Mem:/ {print $2}') * 9 / 10 ))
  cat > "$SLURM_CONF" <<CONF
# written by scripts/services/slurm.sh
ClusterName=qexp
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# no cgroup.conf at all: 22.05 has no way to disable the cgroup plugin, and this machine has no systemd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobCompType=jobcomp/filetxt
JobCompLoc=$D/log/slurm-jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation=$D/slurm-state
SlurmdSpoolDir=$D/slurm-spool
SlurmctldPidFile=$D/slurmctld.daemon.pid
SlurmdPidFile=$D/slurmd.daemon.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
MinJobAge=300
# SLURM's default grace between SIGTERM and SIGKILL: a job's handler asks squeue, sacct and the tracking store before
# it ends its run, which on a loaded node takes more than a few seconds
KillWait=30
InactiveLimit=0
Waittime=0
SchedulerParameters=sched_interval=2
MailProg=/bin/true
# a job that asks no memory gets its share per CPU (not the whole node, which would run one job at a time)
DefMemPerCPU=$((mem / cpus))
NodeName=$NODE CPUs=$cpus RealMemory=$mem State=UNKNOWN
# Pre-emption as a lab's scavenger partition has it: a job of partition urgent that needs the node requeues the
# jobs of partition debug. They get SIGTERM at once and GraceTime to end (SchedulerParameters=preempt_send_user_signal
# would send submitit's USR2 instead; SLURM's default, kept here, is the case qexp must tell from scancel).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=30
PartitionName=urgent Nodes=$NODE MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
  [ -s "$D/slurmdb-password" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$D/slurmdb-password")
  (umask 077; cat > "$CONF_DIR/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=$(cat "$D/slurmdb-password")
StorageLoc=slurm_acct_db
LogFile=$D/log/slurmdbd.log
PidFile=$D/slurmdbd.daemon.pid
DebugLevel=info
CONF
  )
}

wait_for() {  # wait_for WHAT SECONDS COMMAND...
  local what=$1 seconds=$2; shift 2
  for _ in $(seq $((seconds * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what did not come up within $seconds s (logs in $D/log)"
}

start_munge() {
  mkdir -p /run/munge; chown munge:munge /run/munge; chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  fi
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    su -s /bin/sh munge -c '/usr/sbin/munged --force'
    wait_for munged 10 sh -c 'munge -n | unmunge'
  fi
}

start_mariadb() {
  local sock=$D/mysqlrun/mysqld.sock
  mkdir -p "$D/mysql" "$D/mysqlrun"; chown mysql:mysql "$D/mysql" "$D/mysqlrun"
  [ -d "$D/mysql/mysql" ] || mariadb-install-db --user=mysql --datadir="$D/mysql" \
    --auth-root-authentication-method=socket > "$D/log/mariadb-install.log" 2>&1 \
    || die "mariadb-install-db failed (see $D/log/mariadb-install.log)"
  if ! mariadb -S "$sock" -e 'select 1' >/dev/null 2>&1; then
    setsid nohup /usr/sbin/mariadbd --user=mysql --datadir="$D/mysql" --socket="$sock" \
      --pid-file="$D/mysqlrun/mariadbd.pid" --port="$MYSQL_PORT" --bind-address=127.0.0.1 \
      --log-error="$D/log/mariadb.err" --innodb-buffer-pool-size=64M > /dev/null 2>&1 &
    wait_for MariaDB 30 mariadb -S "$sock" -e 'select 1'
  fi
  local pw; pw=$(cat "$D/slurmdb-password")
  mariadb -S "$sock" <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pw';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL
}

daemon() {  # daemon NAME COMMAND...: in the foreground of its own session, its pid in $D/NAME.pid
  local name=$1; shift
  if [ -s "$D/$name.pid" ] && kill -0 "$(cat "$D/$name.pid")" 2>/dev/null; then return 0; fi
  setsid nohup "$@" > "$D/log/$name.out" 2>&1 &
  echo $! > "$D/$name.pid"
}

start() {
  [ "$(id -u)" = 0 ] || die "a local SLURM cluster needs root (slurmd runs jobs as their users)"
  need_debian slurmctld slurm-wlm munge
  need_debian slurmdbd slurmdbd
  need_debian mariadbd mariadb-server
  write_configs
  start_munge
  start_mariadb
  daemon slurmdbd /usr/sbin/slurmdbd -D
  wait_for slurmdbd 30 bash -c '(echo > /dev/tcp/127.0.0.1/6819)'
  sacctmgr -i add cluster qexp >/dev/null 2>&1 || true
  daemon slurmctld /usr/sbin/slurmctld -D -i
  wait_for slurmctld 30 sh -c 'scontrol ping | grep -q UP'
  daemon slurmd /usr/sbin/slurmd -D
  wait_for "the node" 60 sh -c "sinfo -h -o %t | grep -qE '^idle'"
  say "SLURM up (node $NODE idle) after $(elapsed) s" >&2
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
  for name in slurmd slurmctld slurmdbd; do stop_pidfile "$D/$name.pid"; done
  stop_pidfile "$D/mysqlrun/mariadbd.pid"
  # munged is shared by anything on this host that uses munge: left running
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo; squeue ;;
  conf) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) die "usage: $0 start|stop|status|conf" ;;
esac
