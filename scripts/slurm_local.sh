#!/usr/bin/env bash
# A real one-node SLURM on this machine, for the cluster tests (tests/slurm/) and for trying examples/slurm/:
#   bash scripts/slurm_local.sh start    # install slurm-wlm + munge if missing (root), configure, start, wait idle
#   bash scripts/slurm_local.sh status   # sinfo, or exit 1 when no controller answers
#   bash scripts/slurm_local.sh stop     # stop slurmd, slurmctld and munged (state is kept under /var/spool)
# The node is this host with its CPU count and memory; one partition "debug" that oversubscribes (4 jobs per core),
# no accounting (submitit falls back from sacct to squeue). Debian's slurm-wlm 22.05; the recipe is in
# ../shared/FACTS.md ("A real SLURM on this machine").
set -euo pipefail
action=${1:-status}
conf_dir=/etc/slurm
conf=$conf_dir/slurm.conf

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "slurm_local: '$action' needs root (it installs packages and starts daemons); run it with sudo" >&2
    exit 2
  fi
}

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || { echo "slurm_local: no apt-get here: install slurm-wlm and munge yourself" >&2; exit 2; }
  apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
}

write_conf() {
  local cpus mem_mb
  cpus=$(nproc)
  mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))  # 90%: slurmd refuses more than it sees
  mkdir -p "$conf_dir" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  cat > "$conf" <<EOF
# written by scripts/slurm_local.sh: one node (this host), for tests
ClusterName=local
SlurmctldHost=localhost
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=300
KillWait=30
NodeName=localhost CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

start_munge() {
  [ -f /etc/munge/munge.key ] || mungekey --create >/dev/null 2>&1 || true
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    su -s /bin/sh munge -c munged
  fi
}

idle() {
  sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'
}

case "$action" in
  start)
    need_root
    install
    write_conf
    start_munge
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    for _ in $(seq 1 60); do
      if idle; then
        scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
        echo "slurm_local: up ($(sinfo -h -o '%P %D node(s) %c CPUs %t'))"
        exit 0
      fi
      sleep 0.5
    done
    echo "slurm_local: the node did not become idle in 30 s; see /var/log/slurm/" >&2
    exit 1
    ;;
  stop)
    need_root
    pkill -x slurmd 2>/dev/null || true
    pkill -x slurmctld 2>/dev/null || true
    pkill -x munged 2>/dev/null || true
    echo "slurm_local: stopped"
    ;;
  status)
    if command -v sinfo >/dev/null && idle; then
      sinfo
    else
      echo "slurm_local: no SLURM controller answers here; start one with: sudo bash scripts/slurm_local.sh start" >&2
      exit 1
    fi
    ;;
  *)
    echo "usage: bash scripts/slurm_local.sh start|stop|status" >&2
    exit 2
    ;;
esac
