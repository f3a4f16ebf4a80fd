#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the Slurm test lane (docs/slurm.md).
#   bash scripts/slurm_local.sh start   # install slurm-wlm + munge if absent, start the daemons
#   bash scripts/slurm_local.sh stop    # stop exactly the daemons `start` started (their pids, recorded)
#   bash scripts/slurm_local.sh env     # print the exports that point the Slurm commands at it
# Everything lives in $FTLAUNCH_SLURM_SCRATCH (default /tmp/ftlaunch-slurm): config, munge key and
# socket, state, spool, logs, pid files; ports $FTLAUNCH_SLURM_PORT (default 16917) and the two after
# for the nodes. The nodes are named node1 and node2, reached at localhost (NodeAddr), names that do not
# resolve: that is the MASTER_ADDR case of issue 22. Exit 3 when this machine cannot run it (no apt or
# no root): the reason is printed and the lane is skipped.
set -euo pipefail
SCRATCH=${FTLAUNCH_SLURM_SCRATCH:-/tmp/ftlaunch-slurm}
PORT=${FTLAUNCH_SLURM_PORT:-16917}
CONF=$SCRATCH/slurm.conf
SOCKET=$SCRATCH/munge/munge.socket
NODES=(node1 node2)

say() { echo "slurm_local: $*" >&2; }

can_run() {  # prints why not, returns 1, when this machine cannot host the cluster
  if [ "$(id -u)" -ne 0 ]; then echo "not root (slurmd and munged run as root here)"; return 1; fi
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  if ! command -v apt-get >/dev/null; then echo "slurm-wlm/munge absent and no apt-get to install them"; return 1; fi
  return 0
}

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  say "installing slurm-wlm and munge (apt)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_config() {
  mkdir -p "$SCRATCH"/{state,spool,log,munge}
  for n in "${NODES[@]}"; do mkdir -p "$SCRATCH/spool/$n"; done
  local i=0 nodes=""
  {
    cat <<CONF
ClusterName=ftlaunch
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$SCRATCH/state
SlurmdSpoolDir=$SCRATCH/spool/%n
SlurmctldPidFile=$SCRATCH/slurmctld.pid
SlurmdPidFile=$SCRATCH/slurmd.%n.pid
SlurmctldLogFile=$SCRATCH/log/slurmctld.log
SlurmdLogFile=$SCRATCH/log/slurmd.%n.log
SlurmctldPort=$PORT
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
MinJobAge=300
CONF
    for n in "${NODES[@]}"; do
      i=$((i + 1))
      echo "NodeName=$n NodeHostname=localhost NodeAddr=localhost Port=$((PORT + i)) CPUs=2 RealMemory=8000 State=UNKNOWN"
      nodes="${nodes:+$nodes,}$n"
    done
    echo "PartitionName=cpu Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
  } >"$CONF"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# What this script started: "pidfile pid" lines. A daemon already up (started by an earlier `start`)
# is used, not listed again; `stop` ends only the listed pids, so it never ends what it did not start.
STARTED=$SCRATCH/started
started() { echo "$1 $(cat "$1")" >>"$STARTED"; }

wait_pidfile() {
  for _ in $(seq 100); do alive "$1" && return 0; sleep 0.1; done
  say "$1 did not appear"; exit 1
}

start() {
  local why
  if ! why=$(can_run); then say "cannot start a cluster here: $why"; exit 3; fi
  install
  write_config
  if ! alive "$SCRATCH/munged.pid"; then
    if [ ! -f "$SCRATCH/munge/munge.key" ]; then
      dd if=/dev/urandom of="$SCRATCH/munge/munge.key" bs=1024 count=1 status=none
      chmod 0400 "$SCRATCH/munge/munge.key"
    fi
    munged --force --key-file="$SCRATCH/munge/munge.key" --socket="$SOCKET" \
      --pid-file="$SCRATCH/munged.pid" --log-file="$SCRATCH/log/munged.log" --seed-file="$SCRATCH/munge/seed"
    started "$SCRATCH/munged.pid"
  fi
  export SLURM_CONF=$CONF
  if ! alive "$SCRATCH/slurmctld.pid"; then
    slurmctld -i -f "$CONF"
    wait_pidfile "$SCRATCH/slurmctld.pid"
    started "$SCRATCH/slurmctld.pid"
  fi
  for n in "${NODES[@]}"; do
    if ! alive "$SCRATCH/slurmd.$n.pid"; then
      slurmd -N "$n" -f "$CONF"
      wait_pidfile "$SCRATCH/slurmd.$n.pid"
      started "$SCRATCH/slurmd.$n.pid"
    fi
  done
  local deadline=$((SECONDS + 60))
  until [ "$(sinfo -h -o '%T %D' 2>/dev/null | awk '$1=="idle"{s+=$2} END{print s+0}')" -eq ${#NODES[@]} ]; do
    if [ $SECONDS -gt $deadline ]; then say "nodes not idle after 60 s:"; sinfo >&2 || true; exit 1; fi
    sleep 1
  done
  say "cluster up: $(sinfo -h -o '%P %D %T' | tr '\n' ' ')(SLURM_CONF=$CONF)"
}

stop() {
  local f pid
  [ -f "$STARTED" ] || { say "nothing started by this script is running"; return 0; }
  # slurmd first, munged last: the reverse of the start order
  tac "$STARTED" | while read -r f pid; do
    if kill -0 "$pid" 2>/dev/null && [ "$(cat "$f" 2>/dev/null)" = "$pid" ]; then
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$f"
  done
  rm -f "$STARTED"
  rm -rf "$SCRATCH/state"  # a next start begins with no jobs of this one
  say "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  check) if why=$(can_run); then echo ok; else echo "$why"; exit 3; fi ;;
  *) echo "usage: $0 start|stop|env|check" >&2; exit 2 ;;
esac
