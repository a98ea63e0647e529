#!/usr/bin/env bash
# A private, single-host Slurm (munged + slurmctld + slurmd) for testing tfscale's sbatch scripts.
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
# Environment: SLURM_TESTBED_CTLD_PORT / SLURM_TESTBED_SLURMD_PORT fix the daemon ports (default: a
# random free pair in 40000-49999; tfscale's Slurm jobs derive MWMS ports in 20000-39999).
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge shellcheck)
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

write_slurm_conf() {
  local dir=$1 host=$2 ctld_port=$3 slurmd_port=$4
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  cat > "$dir/slurm.conf" << EOF
# Private single-host Slurm written by tools/slurm_testbed.sh; see that script.
ClusterName=tfscale-testbed
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job may start 10 s after its first run ended (default: 121 s).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
# No cgroups or systemd here: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Finished jobs are written here; \`sacct -c\` reads it (no slurmdbd needed).
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
MailProg=/bin/true
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
# Short scheduling and kill delays keep the tests quick.
SchedulerParameters=sched_interval=2
KillWait=30
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

daemon_alive() {
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null
}

wait_for_idle_node() {
  local dir=$1 host=$2 deadline=$((SECONDS + READY_TIMEOUT_S)) grace_end=$((SECONDS + 3)) state="" daemon
  while [ "$SECONDS" -lt "$deadline" ]; do
    state=$(sinfo -h -n "$host" -o %T 2> /dev/null || true)
    if [ "$state" = idle ]; then
      return 0
    fi
    for daemon in slurmctld slurmd; do
      # After a grace period: the daemons write their pid files a moment after forking.
      if [ "$SECONDS" -ge "$grace_end" ] && ! daemon_alive "$dir/$daemon.pid"; then
        die "$daemon exited during start-up; last lines of $dir/log/$daemon.log:
$(tail -n 5 "$dir/log/$daemon.log" 2> /dev/null)"
      fi
    done
    sleep 0.5
  done
  die "node $host not idle after ${READY_TIMEOUT_S}s (state: '${state:-no answer}'); logs in $dir/log"
}

port_in_use() {
  (exec 3<> "/dev/tcp/127.0.0.1/$1") 2> /dev/null
}

# Two adjacent ports nobody listens on, picked at random in 40000-49999 (jobs' MWMS ports sit in
# 20000-39999). A fixed pair would collide with a second testbed or another service.
pick_ports() {
  local port attempt
  for attempt in $(seq 1 50); do
    port=$((40000 + (RANDOM % 5000) * 2))
    if ! port_in_use "$port" && ! port_in_use $((port + 1)); then
      echo "$port"
      return 0
    fi
  done
  die "no free port pair in 40000-49999 after $attempt tries"
}

start() {
  local dir=$1 host
  have_slurm || die "Slurm is not installed: run \`$0 install\` (or \`make slurm\`) as root"
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
  slurmd -f "$SLURM_CONF"
  wait_for_idle_node "$dir" "$host"
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pid_file() {
  local pid_file=$1 pid deadline
  [ -f "$pid_file" ] || return 0
  pid=$(cat "$pid_file")
  kill -TERM "$pid" 2> /dev/null || return 0
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  while kill -0 "$pid" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.2
  done
  kill -KILL "$pid" 2> /dev/null || true
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
  stop_pid_file "$dir/slurmd.pid"
  stop_pid_file "$dir/slurmctld.pid"
  stop_pid_file "$dir/munge/munged.pid"
  rm -rf "$dir"
}

case "${1:-}" in
  install) install_packages ;;
  start) start "${2:?usage: $0 start DIR}" ;;
  stop) stop "${2:?usage: $0 stop DIR}" ;;
  *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
