#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, to try deploy/slurm/libra.sbatch without a cluster.
#
#   bash deploy/slurm/local-cluster.sh start          # as root: munge + slurmctld + slurmd (no systemd needed)
#   export SLURM_CONF=/tmp/libra-slurm/slurm.conf      # printed by start
#   sbatch deploy/slurm/libra.sbatch
#   bash deploy/slurm/local-cluster.sh status
#   bash deploy/slurm/local-cluster.sh stop           # as root: cancels jobs, stops the daemons it started
#
# Several nodes (network namespaces, one slurmd each): scripts/slurm_netns_cluster.sh.
# Needs root (run it with sudo if you are not: slurmd runs jobs as their users; munged runs as `munge`) and Debian/Ubuntu packages
# slurm-wlm slurmctld slurmd slurm-client munge (installed with apt-get when missing).
# Everything lives in LIBRA_SLURM_DIR (default /tmp/libra-slurm): config, state, spool, logs, pids.
# Settings that matter where there are no cgroups and no systemd: ProctrackType=proctrack/pgid
# (linuxproc lets background processes escape), TaskPlugin=task/none.
set -euo pipefail

dir="${LIBRA_SLURM_DIR:-/tmp/libra-slurm}"
conf="$dir/slurm.conf"
node="$(hostname -s)"
cpus="${LIBRA_SLURM_CPUS:-$(nproc)}"
# Leave some memory to the system: Slurm refuses a node that reports less than RealMemory.
mem_mb="${LIBRA_SLURM_MEM_MB:-$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)}"

say() { printf 'local-cluster: %s\n' "$*"; }
die() { printf 'local-cluster: error: %s\n' "$*" >&2; exit 1; }
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  local missing=()
  for binary in slurmctld slurmd sbatch munged; do
    command -v "$binary" >/dev/null 2>&1 || [ -x "/usr/sbin/$binary" ] || missing+=("$binary")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 ||
    die "missing ${missing[*]}; install: apt-get install slurm-wlm slurmctld slurmd slurm-client munge"
  say "installing slurm-wlm slurmctld slurmd slurm-client munge with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  if [ -S /run/munge/munge.socket.2 ] && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged already running"
    return 0
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  touch "$dir/munged.started-by-us"
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && { say "munged started"; return 0; }
    sleep 0.1
  done
  die "munged did not come up; see /var/log/munge/munged.log"
}

write_conf() {
  mkdir -p "$dir"/{state,spool,log}
  cat > "$conf" <<EOF
# Single-node Slurm written by deploy/slurm/local-cluster.sh (for local verification only).
ClusterName=libra-local
SlurmctldHost=$node(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=${LIBRA_SLURMCTLD_PORT:-6817}
SlurmdPort=${LIBRA_SLURMD_PORT:-6818}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

cmd_start() {
  [ "$(id -u)" -eq 0 ] || die "start needs root (slurmd and munged)"
  install_packages
  mkdir -p "$dir"
  if pid_alive "$dir/slurmctld.pid" || pid_alive "$dir/slurmd.pid"; then
    say "already running (stop it first to rewrite the config)"
  else
    start_munge
    write_conf
    slurmctld -f "$conf"
    slurmd -f "$conf"
  fi
  export SLURM_CONF="$conf"
  for _ in $(seq 100); do
    state="$(sinfo -h -n "$node" -o %T 2>/dev/null || true)"
    case "$state" in idle|mixed|allocated) break ;; esac
    sleep 0.2
  done
  case "${state:-}" in
    idle|mixed|allocated) say "node $node is $state ($cpus CPUs, ${mem_mb} MB)" ;;
    *) die "node $node is '${state:-unknown}'; see $dir/log/slurmctld.log and $dir/log/slurmd.log" ;;
  esac
  cat <<EOF
local-cluster: ready. Use it with:
  export SLURM_CONF=$conf
  sbatch deploy/slurm/libra.sbatch
  squeue; scontrol show job JOBID      (no sacct: accounting is off)
  bash deploy/slurm/local-cluster.sh stop
EOF
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE: TERM, wait up to 10 s, then KILL
  local name="$1" pidfile="$2" pid
  pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid="$(cat "$pidfile")"
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  rm -f "$pidfile"
  say "stopped $name (pid $pid)"
}

cmd_stop() {
  if pid_alive "$dir/slurmctld.pid"; then
    export SLURM_CONF="$conf"
    if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
      say "cancelling jobs: $(squeue -h -o %i | tr '\n' ' ')"
      scancel --full $(squeue -h -o %i) || true
      for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  stop_pidfile slurmd "$dir/slurmd.pid"
  stop_pidfile slurmctld "$dir/slurmctld.pid"
  if [ -f "$dir/munged.started-by-us" ]; then
    stop_pidfile munged /run/munge/munged.pid
    rm -f "$dir/munged.started-by-us"
  fi
  say "stopped (state and logs kept in $dir)"
}

cmd_status() {
  for daemon in slurmctld slurmd; do
    if pid_alive "$dir/$daemon.pid"; then say "$daemon running (pid $(cat "$dir/$daemon.pid"))"
    else say "$daemon not running"; fi
  done
  if pid_alive "$dir/slurmctld.pid"; then
    SLURM_CONF="$conf" sinfo
    SLURM_CONF="$conf" squeue
  fi
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status   (LIBRA_SLURM_DIR, LIBRA_SLURM_CPUS, LIBRA_SLURM_MEM_MB)" >&2; exit 2 ;;
esac
