#!/usr/bin/env bash
# A real single-node Slurm on this machine (Debian 12, root): munge + slurmctld + slurmd, for tests.
#   bash scripts/slurm/local_cluster.sh install   # apt-get install slurmctld slurmd slurm-client munge (no
#                                                 # recommended plugins: the tests use none of them)
#   bash scripts/slurm/local_cluster.sh start     # key, config, daemons; waits until the node is idle
#   bash scripts/slurm/local_cluster.sh stop      # stops the daemons this script started
# Verified on Debian 12 with Slurm 22.05 and munge 0.5; the steps are the ones below: a munge key (1024 random
# bytes, owner munge, mode 400) and munged run as the munge user (check: munge -n | unmunge), a slurm.conf with one
# node (this host, its CPUs, 90 % of its memory) and one default partition, then slurmctld and slurmd, until sinfo
# shows the node idle. slurmd's "mpi/pmix_v4 ... can not load PMIx library" at start is harmless.
# A requeued job starts again after cred_expire (10 s; Slurm's default: 120) at the next pass of the main scheduler
# (sched_interval: 2 s; default 60).
set -euo pipefail
state=/run/optim-factory-slurm
case "${1:-}" in
  install)
    command -v slurmctld >/dev/null && command -v munged >/dev/null && exit 0
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null ;;
  start)
    [ "$(id -u)" = 0 ] || { echo "local_cluster.sh: needs root" >&2; exit 1; }
    mkdir -p "$state" /etc/munge /run/munge /var/log/munge /var/lib/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    if [ ! -s /etc/munge/munge.key ]; then
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
    chmod 400 /etc/munge/munge.key
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
      su -s /bin/sh munge -c /usr/sbin/munged
      sleep 1
    fi
    host=$(hostname -s)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS (a test's 1)
    cat > /etc/slurm/slurm.conf <<CONF
ClusterName=optimfactory
SlurmctldHost=${host}
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobRequeue=1
NodeName=${host} CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld -c  # -c: no jobs left from an earlier start
    pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
    for _ in $(seq 1 30); do
      if sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed|allocated"; then echo "slurm up: $(sinfo -h -o '%P %D %T')"; exit 0; fi
      sleep 1
    done
    echo "local_cluster.sh: node did not become idle" >&2; sinfo >&2 || true; exit 1 ;;
  stop)
    for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
      [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    pkill -x slurmd 2>/dev/null || true; pkill -x slurmctld 2>/dev/null || true ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
