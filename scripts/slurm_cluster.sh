#!/usr/bin/env bash
# A one-node Slurm on this machine, for trying the Slurm launcher and its preemption path for
# real (README "Long runs", tests marked `slurm`). Needs root and Debian/Ubuntu packages.
#
#   scripts/slurm_cluster.sh install        # apt-get the daemons, client and munge (~20 s)
#   eval "$(scripts/slurm_cluster.sh start)" # start munged, slurmctld, slurmd; exports SLURM_CONF
#   sbatch ...; squeue; scontrol ...
#   scripts/slurm_cluster.sh stop           # cancel every job, wait for the queue, stop the daemons
#
# Everything lives under SLURM_CLUSTER_DIR (default: under the temp folder): slurm.conf, the
# state and spool folders, the logs and pid files. `start` wipes the state of a previous
# cluster (or slurmctld would bring its jobs back) and prints the export lines; `stop` ends
# only the daemons whose pid files it wrote. Requeued jobs start again within ~8 s:
# cred_expire=5 (Slurm's floor) and a 2 s scheduler loop.
set -euo pipefail

DIR="${SLURM_CLUSTER_DIR:-${TMPDIR:-/tmp}/nemo-replay-slurm}"
CONF="$DIR/slurm.conf"

log() { echo "slurm_cluster: $*" >&2; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        log "already installed: $(sbatch --version 2>/dev/null || echo slurm)"
        return
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
    log "installed $(sbatch --version)"
}

write_conf() {
    local host cpus mem
    host="$(hostname -s)"
    cpus="$(nproc)"
    mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat >"$CONF" <<EOF
ClusterName=nemo-replay-ci
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
SchedulerParameters=sched_interval=2,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    command -v slurmctld >/dev/null || { log "Slurm is not installed: run $0 install (as root)"; exit 1; }
    if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
        log "already running (SLURM_CONF=$CONF)"
    else
        rm -rf "$DIR"
        write_conf
        mkdir -p /run/munge && chown munge:munge /run/munge
        if ! pgrep -x munged >/dev/null; then
            su -s /bin/sh munge -c "/usr/sbin/munged --pid-file=/run/munge/munged.pid"
            cp /run/munge/munged.pid "$DIR/munged.pid"
        fi
        slurmctld -i -f "$CONF"
        slurmd -f "$CONF"
        local i
        for i in $(seq 1 60); do
            if SLURM_CONF="$CONF" sinfo -h -o %t 2>/dev/null | grep -qx idle; then break; fi
            sleep 0.5
        done
        SLURM_CONF="$CONF" sinfo -h -o %t | grep -qx idle || {
            log "the node did not come up; see $DIR/log"; tail -n 20 "$DIR"/log/*.log >&2; exit 1; }
        log "one node idle: $(hostname -s), $(nproc) CPUs (SLURM_CONF=$CONF)"
    fi
    echo "export SLURM_CONF=$CONF"
}

stop_pid() {  # stop_pid NAME: TERM the daemon whose pid file this script wrote, wait for it
    local file="$DIR/$1.pid" pid i
    [ -f "$file" ] || return 0
    pid="$(cat "$file")"
    if kill -TERM "$pid" 2>/dev/null; then
        for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
    rm -f "$file"
}

stop() {
    [ -f "$CONF" ] || { log "no cluster under $DIR"; return 0; }
    if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
        # Jobs first: job processes outlive daemons killed under them.
        SLURM_CONF="$CONF" scancel --full --quiet --user=root 2>/dev/null || true
        local i
        for i in $(seq 1 60); do
            [ -z "$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    stop_pid slurmd
    stop_pid slurmctld
    stop_pid munged
    log "stopped"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 install|start|stop   (cluster folder: $DIR)" >&2; exit 2 ;;
esac
