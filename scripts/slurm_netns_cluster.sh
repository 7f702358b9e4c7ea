#!/usr/bin/env bash
# A multi-node Slurm cluster on this one machine: every node in its own network namespace, with its
# own address and its own slurmd, to run deploy/slurm/libra.sbatch over several nodes without a cluster.
#
#   bash scripts/slurm_netns_cluster.sh start            # as root: 2 nodes (LIBRA_NETNS_NODES=3 for 3)
#   bash scripts/slurm_netns_cluster.sh exec sbatch deploy/slurm/libra.sbatch   # any command, on node0
#   bash scripts/slurm_netns_cluster.sh status
#   bash scripts/slurm_netns_cluster.sh fail node1       # a node failure: its slurmd and jobs die at once
#   bash scripts/slurm_netns_cluster.sh stop             # cancels jobs, stops daemons, deletes the namespaces
#
# Network: node i lives in namespace PREFIX-nI with one veth, libra0, whose address is SUBNET.(10+i)/24;
# the other ends of the veths hang on a bridge inside a namespace of its own (PREFIX-sw), so the
# machine's own network namespace is never touched (no address, no route, no sysctl changes there).
# Addresses stay in the loopback range 127.0.0.0/8 and are only reachable between the namespaces:
# each node namespace enables route_localnet (127.x on a non-loopback interface) and drops its
# `local 127.0.0.0/8` route, keeping 127.0.0.1 for itself, so 127.100.0.11 leaves node0 on the veth.
# The namespaces share the filesystem: munged's socket, the config, the repository and the run
# directory are at the same paths on every "node", as on a cluster with a shared filesystem.
#
# The controller (slurmctld) runs in node0's namespace, so Slurm's client commands must run there
# too: `exec` does that (with SLURM_CONF set). Nodes are node0..nodeN-1 (`slurmd -N`), each with
# LIBRA_NETNS_CPUS CPUs and LIBRA_NETNS_GPUS fake GPUs (gres/gpu over character devices that are
# copies of /dev/null: Slurm binds them to steps through CUDA_VISIBLE_DEVICES like real ones).
# SelectTypeParameters=CR_Core_Memory, as on real clusters, so steps must ask for their memory.
#
# Settings: LIBRA_NETNS_DIR (default /tmp/libra-netns), LIBRA_NETNS_NODES (2), LIBRA_NETNS_CPUS (2),
# LIBRA_NETNS_MEM_MB (4000 per node), LIBRA_NETNS_GPUS (0), LIBRA_NETNS_PREFIX (lbn: names of the
# namespaces and interfaces), LIBRA_NETNS_SUBNET (127.100.0: must be inside 127.0.0.0/8).
# Needs root, iproute2 (ip) and the Debian packages slurm-wlm slurmctld slurmd slurm-client munge.
set -euo pipefail

dir="${LIBRA_NETNS_DIR:-/tmp/libra-netns}"
count="${LIBRA_NETNS_NODES:-2}"
cpus="${LIBRA_NETNS_CPUS:-2}"
mem_mb="${LIBRA_NETNS_MEM_MB:-4000}"
gpus="${LIBRA_NETNS_GPUS:-0}"
prefix="${LIBRA_NETNS_PREFIX:-lbn}"
subnet="${LIBRA_NETNS_SUBNET:-127.100.0}"
conf="$dir/slurm.conf"
IFACE=libra0  # each node's interface on the cluster network

say() { printf 'netns-cluster: %s\n' "$*"; }
die() { printf 'netns-cluster: error: %s\n' "$*" >&2; exit 1; }
ns_of() { echo "$prefix-n$1"; }
addr_of() { echo "$subnet.$((10 + $1))"; }

check_settings() {
  [[ "$count" =~ ^[1-8]$ ]] || die "LIBRA_NETNS_NODES=$count: give 1 to 8 nodes"
  [[ "$subnet" =~ ^127\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
    die "LIBRA_NETNS_SUBNET=$subnet: give the first three octets of a /24 inside 127.0.0.0/8, e.g. 127.100.0"
  [[ "$prefix" =~ ^[a-z][a-z0-9]{0,5}$ ]] || die "LIBRA_NETNS_PREFIX=$prefix: 1-6 lower-case letters/digits"
  [[ "$gpus" =~ ^[0-9]+$ && "$cpus" =~ ^[0-9]+$ && "$mem_mb" =~ ^[0-9]+$ ]] ||
    die "LIBRA_NETNS_GPUS/CPUS/MEM_MB must be whole numbers"
}

check_tools() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, slurmd, munged)"
  command -v ip >/dev/null || die "no 'ip' (iproute2): apt-get install iproute2"
  local missing=()
  for binary in slurmctld slurmd sbatch munged; do
    command -v "$binary" >/dev/null 2>&1 || [ -x "/usr/sbin/$binary" ] || missing+=("$binary")
  done
  [ "${#missing[@]}" -eq 0 ] ||
    die "missing ${missing[*]}: apt-get install slurm-wlm slurmctld slurmd slurm-client munge"
}

start_munge() {
  if [ -S /run/munge/munge.socket.2 ] && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
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

make_network() {
  ip netns add "$prefix-sw"
  ip -n "$prefix-sw" link add br0 type bridge
  ip -n "$prefix-sw" link set br0 up
  local i ns
  for ((i = 0; i < count; i++)); do
    ns="$(ns_of "$i")"
    ip netns add "$ns"
    # Created inside the node's namespace, the other end inside the switch's: the same interface
    # name on every node (IFACE), as on a cluster, for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.
    ip -n "$ns" link add "$IFACE" type veth peer name "${prefix}p$i" netns "$prefix-sw"
    ip -n "$prefix-sw" link set "${prefix}p$i" master br0
    ip -n "$prefix-sw" link set "${prefix}p$i" up
    in_ns "$i" sh -ec "
      ip link set lo up
      ip route del table local local 127.0.0.0/8 dev lo   # keep 127.0.0.1, route the rest of 127/8 out
      sysctl -qw net.ipv4.conf.all.route_localnet=1 net.ipv4.conf.$IFACE.route_localnet=1
      ip addr add $(addr_of "$i")/24 dev $IFACE
      ip link set $IFACE up"
  done
}

write_conf() {
  mkdir -p "$dir"/{state,log,run,dev}
  local i nodes="" gres_line="" gres_conf=""
  if [ "$gpus" -gt 0 ]; then
    gres_line=" Gres=gpu:$gpus"
    for ((i = 0; i < count; i++)); do
      for ((g = 0; g < gpus; g++)); do
        [ -e "$dir/dev/node${i}-gpu$g" ] || mknod "$dir/dev/node${i}-gpu$g" c 1 3  # a /dev/null
      done
      gres_conf+="NodeName=node$i Name=gpu File=$dir/dev/node${i}-gpu[0-$((gpus - 1))]"$'\n'
    done
  fi
  for ((i = 0; i < count; i++)); do
    mkdir -p "$dir/spool/node$i"
    nodes+="NodeName=node$i NodeAddr=$(addr_of "$i") CPUs=$cpus RealMemory=$mem_mb$gres_line State=UNKNOWN"$'\n'
  done
  cat > "$conf" <<EOF
# A ${count}-node Slurm in network namespaces, written by scripts/slurm_netns_cluster.sh (testing only).
ClusterName=libra-netns
SlurmctldHost=$(hostname -s)($(addr_of 0))
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=${LIBRA_NETNS_SLURMD_TIMEOUT:-20}
KillWait=${LIBRA_NETNS_KILL_WAIT:-30}
JobRequeue=1
$nodes
PartitionName=debug Nodes=node[0-$((count - 1))] Default=YES MaxTime=INFINITE State=UP
EOF
  printf '%s' "$gres_conf" > "$dir/gres.conf"
}

in_ns() {  # in_ns NODE_INDEX COMMAND...: run a command in that node's network namespace only
  # (nsenter, not `ip netns exec`: that also remounts /sys, which hides /sys/fs/cgroup from slurmd)
  local i="$1"
  shift
  nsenter --net="/run/netns/$(ns_of "$i")" "$@"
}
slurm_in() { local i="$1"; shift; in_ns "$i" env SLURM_CONF="$conf" "$@"; }  # ... with SLURM_CONF

cmd_start() {
  check_settings
  check_tools
  if ip netns list | grep -q "^$prefix-sw\b"; then
    die "namespaces $prefix-* exist already (a cluster is running?): stop it first, or set LIBRA_NETNS_PREFIX"
  fi
  mkdir -p "$dir"
  printf '%s\n' "$count" > "$dir/nodes"
  start_munge
  write_conf
  make_network
  slurm_in 0 slurmctld -f "$conf"
  local i
  for ((i = 0; i < count; i++)); do
    slurm_in "$i" slurmd -f "$conf" -N "node$i"
  done
  local state=""
  for _ in $(seq 150); do
    state="$(slurm_in 0 sinfo -h -o %T 2>/dev/null | sort -u | tr '\n' ' ')"
    [ "$state" = "idle " ] && break
    sleep 0.2
  done
  [ "$state" = "idle " ] || die "nodes are '${state:-unknown}', not idle; see $dir/log/"
  say "ready: $count nodes ($(for ((i = 0; i < count; i++)); do printf 'node%s=%s ' "$i" "$(addr_of "$i")"; done)), $cpus CPUs, ${mem_mb} MB, $gpus GPUs each"
  say "run Slurm commands on node0: bash $0 exec sbatch ...  (nodes reach each other on interface $IFACE)"
}

known_count() { cat "$dir/nodes" 2>/dev/null || echo "$count"; }

kill_namespace_pids() {  # every process left in a namespace: TERM, then KILL
  local ns="$1" pids
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  [ -n "${pids// }" ] || return 0
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 30); do
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
    [ -n "${pids// }" ] || return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
}

cmd_fail() {  # fail NODE: the node dies: its slurmd, its steps and its network, without warning
  local node="${1:?usage: fail NODE (e.g. node1)}" i="${1#node}"
  [[ "$i" =~ ^[0-9]+$ ]] && [ "$i" -gt 0 ] && [ "$i" -lt "$(known_count)" ] ||
    die "fail $node: give node1..node$(($(known_count) - 1)) (node0 holds the controller)"
  local ns
  ns="$(ns_of "$i")"
  ip -n "$ns" link set "$IFACE" down
  kill -KILL $(ip netns pids "$ns") 2>/dev/null || true
  say "$node failed: its processes were killed and its link is down"
}

cmd_stop() {
  local n i
  n="$(known_count)"
  if ip netns list | grep -q "^$(ns_of 0)\b"; then
    local jobs
    jobs="$(slurm_in 0 squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)"
    if [ -n "${jobs// }" ]; then
      say "cancelling jobs: $jobs"
      slurm_in 0 scancel $jobs 2>/dev/null || true
      for _ in $(seq 60); do [ -z "$(slurm_in 0 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  for ((i = n - 1; i >= 0; i--)); do
    ip netns list | grep -q "^$(ns_of "$i")\b" || continue
    kill_namespace_pids "$(ns_of "$i")"
    ip netns del "$(ns_of "$i")"
  done
  ip netns list | grep -q "^$prefix-sw\b" && ip netns del "$prefix-sw"
  rm -f "$dir"/run/*.pid
  if [ -f "$dir/munged.started-by-us" ]; then
    kill -TERM "$(cat /run/munge/munged.pid 2>/dev/null)" 2>/dev/null || true
    rm -f "$dir/munged.started-by-us"
  fi
  say "stopped: namespaces deleted, daemons gone (logs kept in $dir/log)"
}

cmd_status() {
  ip netns list | grep -q "^$(ns_of 0)\b" || { say "not running"; return 1; }
  slurm_in 0 sinfo -N -o '%N %T %c %m %G'
  slurm_in 0 squeue
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  fail) shift; cmd_fail "$@" ;;
  exec) shift; [ "$#" -gt 0 ] || die "exec COMMAND..."; slurm_in 0 "$@" ;;
  *) echo "usage: $0 start|stop|status|fail NODE|exec COMMAND..." >&2; exit 2 ;;
esac
