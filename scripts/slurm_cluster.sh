#!/usr/bin/env bash
# A one-node (or N-node) Slurm on this machine, for trying the Slurm launcher and its preemption
# path for real (README "Long runs", tests marked `slurm`). Needs root and Debian/Ubuntu packages.
#
#   scripts/slurm_cluster.sh install        # apt-get the daemons, client and munge (~20 s)
#   eval "$(scripts/slurm_cluster.sh start)" # start munged, slurmctld, slurmd; exports SLURM_CONF
#   eval "$(scripts/slurm_cluster.sh start --nodes 2)"  # two nodes, each in a network namespace
#   sbatch ...; squeue; scontrol ...
#   scripts/slurm_cluster.sh node-down 2    # node 2 dies: its link down, its slurmd and processes killed
#   scripts/slurm_cluster.sh node-up 2      # node 2 is back: its link up, its slurmd started again
#   scripts/slurm_cluster.sh stop           # cancel every job, wait for the queue, stop the daemons
#
# Everything lives under SLURM_CLUSTER_DIR (default: under the temp folder): slurm.conf, the
# state and spool folders, the logs and pid files. `start` wipes the state of a previous
# cluster (or slurmctld would bring its jobs back) and prints the export lines; `stop` ends
# only the daemons whose pid files it wrote. Requeued jobs start again within ~8 s:
# cred_expire=5 (Slurm's floor) and a 2 s scheduler loop.
#
# --nodes N > 1: node i is nr-node<i> at $NET.(10+i) (NET: SLURM_CLUSTER_NET, default
# 10.213.48) in the network namespace nemo-replay-node<i>, linked by a veth pair (nr-node<i>-h
# here, nr-node<i> there) to the bridge nr-slurm-br ($NET.1, where slurmctld answers). Each
# node's slurmd runs inside its namespace (nsenter) under a hostname of its own (`unshare -u`,
# so that torchrun and gloo there see nr-node<i>) and with $DIR/hosts, which names every node,
# mounted over /etc/hosts in a mount namespace of its own (`unshare -m`; `ip netns exec` would
# remount /sys, hiding the cgroup mounts slurmd reads), as `slurmd -N nr-node<i>`. munged stays
# here: its socket is a file that every namespace reaches. Whatever `start` made is listed in
# $DIR/made, and `stop` removes exactly that, by name.
set -euo pipefail

DIR="${SLURM_CLUSTER_DIR:-${TMPDIR:-/tmp}/nemo-replay-slurm}"
CONF="$DIR/slurm.conf"
NET="${SLURM_CLUSTER_NET:-10.213.48}"
BRIDGE=nr-slurm-br

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

conf_common() {  # the settings every cluster shape shares
    cat <<EOF
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
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmctldPort=6817
SlurmdPort=6818
EOF
}

write_conf() {
    local host cpus mem
    host="$(hostname -s)"
    cpus="$(nproc)"
    mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    {
        conf_common
        cat <<EOF
SlurmdSpoolDir=$DIR/spool
SlurmdPidFile=$DIR/slurmd.pid
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    } >"$CONF"
}

write_conf_nodes() {  # write_conf_nodes N: N nodes at their own addresses, slurmctld on the bridge
    local n="$1" cpus mem i
    cpus="$(nproc)"
    mem="$(awk -v n="$n" '/MemTotal/ {print int($2 / 1024 * 0.8 / n)}' /proc/meminfo)"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    # SlurmdTimeout: a node silent for 20 s is DOWN, and its jobs end (NODE_FAIL) or are requeued.
    {
        conf_common
        cat <<EOF
SlurmctldAddr=$NET.1
SlurmdTimeout=20
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
EOF
        for i in $(seq 1 "$n"); do
            echo "NodeName=nr-node$i NodeAddr=$NET.$((10 + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=nr-node[1-$n] Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
}

made() { echo "$1" >>"$DIR/made"; }  # made KIND:NAME: one thing `stop` removes

make_network() {  # make_network N: the bridge, the nodes' hosts file, per node a namespace and a veth pair
    local n="$1" i ns
    for i in $(seq 1 "$n"); do
        ns="nemo-replay-node$i"
        if ip netns list | grep -qw "$ns" || ip link show "nr-node$i-h" >/dev/null 2>&1; then
            log "namespace $ns or link nr-node$i-h exists, and $DIR/made does not list it: another cluster's?"
            log "stop that cluster (SLURM_CLUSTER_DIR=<its folder> $0 stop) or remove them (ip netns del $ns; ip link del nr-node$i-h)"
            exit 1
        fi
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        log "link $BRIDGE exists, and $DIR/made does not list it: stop the cluster that made it, or ip link del $BRIDGE"
        exit 1
    fi
    ip link add "$BRIDGE" type bridge && made "link:$BRIDGE"
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    echo "127.0.0.1 localhost" >"$DIR/hosts"
    for i in $(seq 1 "$n"); do echo "$NET.$((10 + i)) nr-node$i" >>"$DIR/hosts"; done
    for i in $(seq 1 "$n"); do
        ns="nemo-replay-node$i"
        ip netns add "$ns" && made "netns:$ns"
        ip link add "nr-node$i-h" type veth peer name "nr-node$i" && made "link:nr-node$i-h"
        ip link set "nr-node$i" netns "$ns"
        ip link set "nr-node$i-h" master "$BRIDGE"
        ip link set "nr-node$i-h" up
        ip netns exec "$ns" ip addr add "$NET.$((10 + i))/24" dev "nr-node$i"
        ip netns exec "$ns" ip link set "nr-node$i" up
        ip netns exec "$ns" ip link set lo up
    done
}

remove_network() {  # what make_network listed in $DIR/made, by name: links, then namespaces
    [ -f "$DIR/made" ] || return 0
    local kind name
    while IFS=: read -r kind name; do
        if [ "$kind" = link ]; then ip link del "$name" 2>/dev/null || true; fi
    done <"$DIR/made"
    while IFS=: read -r kind name; do
        if [ "$kind" = netns ]; then ip netns del "$name" 2>/dev/null || true; fi
    done <"$DIR/made"
    rm -f "$DIR/made"
}

start_node() {  # start_node I: the slurmd of nr-node<I>, inside its namespace, under its own hostname
    mkdir -p "$DIR/spool/nr-node$1"
    nsenter --net="/run/netns/nemo-replay-node$1" unshare -m -u sh -c \
        "mount --bind '$DIR/hosts' /etc/hosts && hostname nr-node$1 && exec slurmd -N nr-node$1 -f '$CONF'"
}

idle_nodes() { SLURM_CONF="$CONF" sinfo -h -N -o %t 2>/dev/null | grep -cx idle || true; }

start() {
    local nodes=1 i
    while [ $# -gt 0 ]; do
        case "$1" in
            --nodes) nodes="${2:-}"; shift; shift || true ;;
            *) log "start: unknown argument '$1'; expected --nodes N"; exit 2 ;;
        esac
    done
    [[ "$nodes" =~ ^[1-9][0-9]?$ ]] || { log "start: --nodes takes a count from 1 to 99, got '$nodes'"; exit 2; }
    command -v slurmctld >/dev/null || { log "Slurm is not installed: run $0 install (as root)"; exit 1; }
    if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
        local running
        running="$(grep -c '^NodeName=' "$CONF")"
        if [ "$running" != "$nodes" ]; then
            log "a cluster of $running node(s) is already running under $DIR, not $nodes: stop it first ($0 stop)"
            exit 1
        fi
        log "already running (SLURM_CONF=$CONF)"
    else
        remove_network  # of a previous cluster here that was not stopped
        rm -rf "$DIR"
        if [ "$nodes" = 1 ]; then
            write_conf
        else
            mkdir -p "$DIR"
            make_network "$nodes"
            write_conf_nodes "$nodes"
        fi
        mkdir -p /run/munge && chown munge:munge /run/munge
        if ! pgrep -x munged >/dev/null; then
            su -s /bin/sh munge -c "/usr/sbin/munged --pid-file=/run/munge/munged.pid"
            cp /run/munge/munged.pid "$DIR/munged.pid"
        fi
        slurmctld -i -f "$CONF"
        if [ "$nodes" = 1 ]; then
            slurmd -f "$CONF"
        else
            for i in $(seq 1 "$nodes"); do start_node "$i"; done
        fi
        for i in $(seq 1 60); do
            [ "$(idle_nodes)" = "$nodes" ] && break
            sleep 0.5
        done
        [ "$(idle_nodes)" = "$nodes" ] || {
            log "$(idle_nodes) of $nodes nodes came up; see $DIR/log"; tail -n 20 "$DIR"/log/*.log >&2; exit 1; }
        if [ "$nodes" = 1 ]; then
            log "one node idle: $(hostname -s), $(nproc) CPUs (SLURM_CONF=$CONF)"
        else
            log "$nodes nodes idle: nr-node[1-$nodes] at $NET.11-$((10 + nodes)), $(nproc) CPUs each (SLURM_CONF=$CONF)"
        fi
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
    [ -f "$CONF" ] || { log "no cluster under $DIR"; remove_network; return 0; }
    if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
        # Jobs first: job processes outlive daemons killed under them.
        SLURM_CONF="$CONF" scancel --full --quiet --user=root 2>/dev/null || true
        local i
        for i in $(seq 1 60); do
            [ -z "$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    local file
    for file in "$DIR"/slurmd.pid "$DIR"/slurmd-*.pid; do
        if [ -f "$file" ]; then stop_pid "$(basename "$file" .pid)"; fi
    done
    stop_pid slurmctld
    stop_pid munged
    remove_network
    log "stopped"
}

node_index() {  # node_index I: fails unless this cluster made node nr-node<I>
    if ! { [[ "${1:-}" =~ ^[0-9]+$ ]] && grep -qx "netns:nemo-replay-node$1" "$DIR/made" 2>/dev/null; }; then
        log "no node '${1:-}' in the cluster under $DIR; expected the index of one of its nodes:" \
            "$(sed -n 's/^netns:nemo-replay-node//p' "$DIR/made" 2>/dev/null | tr '\n' ' ')(start --nodes N makes 1..N)"
        exit 2
    fi
}

node_down() {  # node_down I: nr-node<I> dies: silent on the network first, then every process in it killed
    node_index "$1"
    local ns="nemo-replay-node$1" pids
    ip netns exec "$ns" ip link set "nr-node$1" down
    pids="$(ip netns pids "$ns" | tr '\n' ' ')"  # its slurmd and every process of its job steps
    if [ -n "$pids" ]; then kill -KILL $pids 2>/dev/null || true; fi
    rm -f "$DIR/slurmd-nr-node$1.pid"
    log "nr-node$1 is down: its link is down and its processes are killed ($pids)"
}

node_up() {  # node_up I: nr-node<I> is back: its link up, its slurmd started again
    node_index "$1"
    ip netns exec "nemo-replay-node$1" ip link set "nr-node$1" up
    start_node "$1"
    log "nr-node$1 is up: its slurmd started; Slurm returns it to service when it registers (ReturnToService=2)"
}

case "${1:-}" in
    install) install ;;
    start) shift; start "$@" ;;
    stop) stop ;;
    node-down) node_down "${2:-}" ;;
    node-up) node_up "${2:-}" ;;
    *) echo "usage: $0 install | start [--nodes N] | stop | node-down I | node-up I   (cluster folder: $DIR)" >&2
       exit 2 ;;
esac
