#!/usr/bin/env bash
# A private, single-host Slurm (munged + slurmctld + two slurmd) for testing tfscale's sbatch scripts.
#
#   tools/slurm_testbed.sh install          apt-get the Debian packages if missing (root; what `make slurm` runs)
#   tools/slurm_testbed.sh start DIR        write DIR/slurm.conf + a munge key, start the daemons,
#                                           wait until the node is idle; prints `export SLURM_CONF=...`
#   tools/slurm_testbed.sh stop DIR         cancel the testbed's jobs, stop its daemons, delete DIR
#
# Everything (config, key, sockets, state, logs) lives in DIR; nothing under /etc is used, so the
# testbed does not disturb (or depend on) a system Slurm. Without systemd the daemons are started
# by hand; `stop` ends exactly the processes whose pid files `start` wrote.
#
# Nodes: `hostname -s`, alone in the default partition `debug`, and a second node emulated on the
# same host, named `localhost` (a name every host resolves to itself), which joins the first in the
# partition `pair`. Jobs there span two nodes, so a job step can use part of an allocation (its
# SLURM_STEP_NODELIST differs from SLURM_JOB_NODELIST) as on a real cluster. Each node has its own
# slurmd (`slurmd -N NAME`: own port, spool, pid and log file). A host named localhost gets no
# second node and no `pair` partition.
#
# Across hosts: with SLURM_TESTBED_NETBED=PREFIX, the nodes are hosts 0 and 1 of that test bed
# (tools/netbed.py up --prefix=PREFIX --hosts=2; tfscale/launch/netbed.py), named after them: each slurmd
# runs in its host's network namespace under the host's name, at the host's address, and slurmctld on this
# host at the bed's bridge address. `debug` holds host 0, `pair` both. Jobs, srun steps and their tasks
# then talk across addresses, as on a cluster. Each node also has a local disk of its own: DIR/local is a
# tmpfs private to that node's slurmd and its tasks (the directory itself stays empty on this host), so
# what a job stages there on one node the other node does not see.
#
# Environment: SLURM_TESTBED_CTLD_PORT / SLURM_TESTBED_SLURMD_PORT fix the daemon ports (the second
# slurmd takes the next port; default: a random free triple in 40000-49999; tfscale's Slurm jobs
# derive MWMS ports in 20000-39999).
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge shellcheck)
SECOND_NODE=localhost
PAIR_PARTITION=pair
READY_TIMEOUT_S=${SLURM_TESTBED_READY_TIMEOUT_S:-60}
STOP_TIMEOUT_S=10

die() {
  echo "slurm_testbed: $*" >&2
  exit 1
}

have_slurm() {
  command -v slurmctld > /dev/null && command -v slurmd > /dev/null && command -v sbatch > /dev/null \
    && command -v munged > /dev/null
}

# The linter of the sbatch templates (tests/test_make_sbatch.py) is installed alongside.
have_packages() {
  have_slurm && command -v shellcheck > /dev/null
}

install_packages() {
  if have_packages; then
    echo "slurm_testbed: Slurm, munge and shellcheck already installed"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "installing ${PACKAGES[*]} needs root (apt-get); the Slurm tests will be skipped"
  command -v apt-get > /dev/null || die "no apt-get: install ${PACKAGES[*]} by hand; the Slurm tests will be skipped"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" > /dev/null
  echo "slurm_testbed: installed slurm $(dpkg-query -W -f='${Version}' slurmctld)"
}

write_munge_key() {
  local dir=$1
  mkdir -p "$dir/munge"
  # 1024 random bytes: munge's own key size; owned by munge and private, or munged refuses to start.
  head -c 1024 /dev/urandom > "$dir/munge/munge.key"
  chown -R munge:munge "$dir/munge"
  chmod 0711 "$dir/munge"  # clients need to reach the socket in it
  chmod 0400 "$dir/munge/munge.key"
}

start_munged() {
  local dir=$1
  runuser -u munge -- munged \
    --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
}

NETBED=${SLURM_TESTBED_NETBED:-}
NETBED_STATE_DIR=/run/tfscale-netbed

# A field of the test bed's state file: `netbed_field bridge_address`, `netbed_field hosts N namespace`.
netbed_field() {
  python3 -c 'import json, sys
value = json.load(open(sys.argv[1]))
for key in sys.argv[2:]:
    value = value[int(key) if isinstance(value, list) else key]
print(value)' "$NETBED_STATE_DIR/$NETBED.json" "$@"
}

# The testbed's node names: the host, then the emulated second node (unless the host has its name);
# on a test bed, its hosts 0 and 1.
node_names() {
  local host=$1
  if [ -n "$NETBED" ]; then
    netbed_field hosts 0 namespace
    netbed_field hosts 1 namespace
    return
  fi
  echo "$host"
  if [ "$host" != "$SECOND_NODE" ]; then
    echo "$SECOND_NODE"
  fi
}

# NodeName and PartitionName lines: node i gets slurmd port slurmd_port+i.
node_lines() {
  local host=$1 slurmd_port=$2 name address=127.0.0.1 i=0 names=()
  for name in $(node_names "$host"); do
    if [ -n "$NETBED" ]; then
      address=$(netbed_field hosts "$i" address)
    fi
    echo "NodeName=$name NodeAddr=$address Port=$((slurmd_port + i)) CPUs=$(nproc) State=UNKNOWN"
    names+=("$name")
    i=$((i + 1))
  done
  echo "PartitionName=debug Nodes=${names[0]} Default=YES MaxTime=INFINITE State=UP"
  if [ "$i" = 2 ]; then
    echo "PartitionName=$PAIR_PARTITION Nodes=${names[0]},${names[1]} MaxTime=INFINITE State=UP"
  fi
}

# Where slurmd and the jobs reach slurmctld: loopback, or the bed's bridge address.
ctld_address() {
  if [ -n "$NETBED" ]; then
    netbed_field bridge_address
  else
    echo 127.0.0.1
  fi
}

# slurmd for node NAME: here, or in its bed host's network namespace under its name, with the bed's
# /etc/hosts and its own local disk at DIR/local (it forks into the background there, and its tasks stay
# there). Not `ip netns exec`, which mounts a fresh /sys without the cgroup hierarchy that slurmd reads.
start_slurmd() {
  local dir=$1 name=$2
  if [ -n "$NETBED" ]; then
    # shellcheck disable=SC2016  # expanded by the inner sh, from its arguments
    nsenter --net="/run/netns/$name" unshare --uts --mount sh -c \
      'mount --bind "/etc/netns/$0/hosts" /etc/hosts && mount -t tmpfs -o size=512m "local-$0" "$2/local" \
       && hostname "$0" && exec slurmd -f "$1" -N "$0"' "$name" "$SLURM_CONF" "$dir"
  else
    slurmd -f "$SLURM_CONF" -N "$name"
  fi
}

write_slurm_conf() {
  local dir=$1 host=$2 ctld_port=$3 slurmd_port=$4 name
  mkdir -p "$dir/state" "$dir/log" "$dir/local"
  for name in $(node_names "$host"); do
    mkdir -p "$dir/spool/$name" "$dir/tmp/$name"
  done
  cat > "$dir/slurm.conf" << EOF
# Private single-host Slurm written by tools/slurm_testbed.sh; see that script.
ClusterName=tfscale-testbed
SlurmctldHost=$host($(ctld_address))
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5 (Slurm's minimum): a requeued job may start 6 s after its first run ended (default: 121 s).
# A step's credential must still reach its slurmd within those 5 s, milliseconds on one host.
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
# %n: the node name, so that the two slurmd of this host keep apart.
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# Per node and per testbed: srun --mpi=pmix creates its PMIx client directory
# TmpFS/spmix_appdir_<uid>_<job>.<step> there. With the default /tmp the two nodes of this host (and
# two testbeds, whose job ids both start at 1) would create the same one and the step fails to
# launch ("Cannot create client cli tmpdir ... File exists"). PMIxCliTmpDirBase (mpi.conf) would
# not do: it does not expand %n.
TmpFS=$dir/tmp/%n
# No cgroups or systemd here: track processes by parent pid; task/affinity binds tasks with sched_setaffinity
# (srun --cpu-bind=cores, as the sbatch templates pass it), so each task sees only its own cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Finished jobs are written here; \`sacct -c\` reads it (no slurmdbd needed).
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
MailProg=/bin/true
# Steps choose their PMI: srun --mpi=pmix (Debian's OpenMPI 4.1 speaks PMIx only; pmi2 fails in MPI_Init).
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
# Short scheduling and kill delays keep the tests quick: every pending job is tried each second
# (slurmctld's timer), and a submitted or requeued batch job or a freed node is acted on at the next
# tick instead of after batch_sched_delay (default: 3 s).
SchedulerParameters=sched_interval=1,batch_sched_delay=0
KillWait=30
$(node_lines "$host" "$slurmd_port")
EOF
}

daemon_alive() {
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null
}

# "name state" of each testbed node that is not idle yet; nothing once all are.
busy_nodes() {
  local host=$1 states name
  if ! states=$(sinfo -h -N -o "%N %T" 2> /dev/null); then
    echo "(slurmctld does not answer yet)"
    return
  fi
  for name in $(node_names "$host"); do
    if ! grep -qx "$name idle" <<< "$states"; then
      echo "$name $(grep "^$name " <<< "$states" | cut -d' ' -f2)"
    fi
  done
}

wait_for_idle_nodes() {
  local dir=$1 host=$2 deadline=$((SECONDS + READY_TIMEOUT_S)) grace_end=$((SECONDS + 3)) busy="" daemon
  while [ "$SECONDS" -lt "$deadline" ]; do
    busy=$(busy_nodes "$host")
    if [ -z "$busy" ]; then
      return 0
    fi
    for daemon in slurmctld $(node_names "$host" | sed 's/^/slurmd-/'); do
      # After a grace period: the daemons write their pid files a moment after forking.
      if [ "$SECONDS" -ge "$grace_end" ] && ! daemon_alive "$dir/$daemon.pid"; then
        die "$daemon exited during start-up; last lines of $dir/log/$daemon.log:
$(tail -n 5 "$dir/log/$daemon.log" 2> /dev/null)"
      fi
    done
    sleep 0.5
  done
  die "nodes not idle after ${READY_TIMEOUT_S}s: $(paste -sd ';' <<< "$busy"); logs in $dir/log"
}

port_in_use() {
  (exec 3<> "/dev/tcp/127.0.0.1/$1") 2> /dev/null
}

# Three adjacent ports nobody listens on (slurmctld, the two slurmd), picked at random in
# 40000-49999 (jobs' MWMS ports sit in 20000-39999). Fixed ones would collide with a second
# testbed or another service.
pick_ports() {
  local port attempt
  for attempt in $(seq 1 50); do
    port=$((40000 + (RANDOM % 3333) * 3))
    if ! port_in_use "$port" && ! port_in_use $((port + 1)) && ! port_in_use $((port + 2)); then
      echo "$port"
      return 0
    fi
  done
  die "no 3 free adjacent ports in 40000-49999 after $attempt tries"
}

start() {
  local dir=$1 host
  have_slurm || die "Slurm is not installed: run \`$0 install\` (or \`make slurm\`) as root"
  if [ -n "$NETBED" ] && [ ! -f "$NETBED_STATE_DIR/$NETBED.json" ]; then
    die "no test bed $NETBED ($NETBED_STATE_DIR/$NETBED.json): python tools/netbed.py up --prefix=$NETBED --hosts=2"
  fi
  [ "$(id -u)" = 0 ] || die "starting private Slurm daemons needs root (SlurmUser=root, munged as user munge)"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  chmod 0711 "$dir"  # munged (user munge) must reach its own subdirectory
  host=$(hostname -s)
  write_munge_key "$dir"
  start_munged "$dir"
  local port
  port=$(pick_ports)
  write_slurm_conf "$dir" "$host" "${SLURM_TESTBED_CTLD_PORT:-$port}" "${SLURM_TESTBED_SLURMD_PORT:-$((port + 1))}"
  export SLURM_CONF=$dir/slurm.conf
  # -c: start from a clean state (no jobs from an earlier testbed in this directory).
  slurmctld -c -f "$SLURM_CONF"
  local name
  for name in $(node_names "$host"); do
    start_slurmd "$dir" "$name"
  done
  wait_for_idle_nodes "$dir" "$host"
  echo "export SLURM_CONF=$SLURM_CONF"
}

# TERM to every pid-file's process at once (each daemon takes ~2 s to shut down, ~8 s one after the
# other), then KILL whatever is still running STOP_TIMEOUT_S later.
stop_pid_files() {
  local pid_file pid pids=() deadline
  for pid_file in "$@"; do
    [ -f "$pid_file" ] || continue
    pid=$(cat "$pid_file")
    if kill -TERM "$pid" 2> /dev/null; then
      pids+=("$pid")
    fi
  done
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  for pid in ${pids[@]+"${pids[@]}"}; do
    while kill -0 "$pid" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do
      sleep 0.1
    done
    kill -KILL "$pid" 2> /dev/null || true
  done
}

cancel_jobs() {
  local deadline=$((SECONDS + 40))  # KillWait (30 s) plus slack
  scancel --full --signal=KILL --user="$(id -un)" 2> /dev/null || true
  scancel --user="$(id -un)" 2> /dev/null || true
  while [ -n "$(squeue -h -o %i 2> /dev/null)" ] && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.5
  done
}

stop() {
  local dir=$1
  [ -d "$dir" ] || return 0
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/slurm.conf" ]; then
    export SLURM_CONF=$dir/slurm.conf
    cancel_jobs
  fi
  stop_pid_files "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munge/munged.pid"
  rm -rf "$dir"
}

case "${1:-}" in
  install) install_packages ;;
  start) start "${2:?usage: $0 start DIR}" ;;
  stop) stop "${2:?usage: $0 stop DIR}" ;;
  *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
