#!/usr/bin/env bash
# Several machines, a death recovered in-process under torchrun: run this same command on every machine.
#
# It starts NPROC processes here, each under a torchrun agent of its own (`torchrun --standalone
# --nproc-per-node 1 --max-restarts 0`), so no agent restarts or tears down another's process when one
# dies: the job's fail_stop recovery handles every death. The ranks come from a small store on
# RANKS_HOST (resihp_lightning.process_ranks; needed only at start). The job's fail_stop store runs on
# the first machine in name order at STORE_PORT, unless ETCD_MEMBERS is set:
#
#   RANKS_HOST=node0 NNODES=3 NPROC=8 RUN_DIR=/shared/runs/llama examples/torchrun_per_process.sh \
#       --config examples/configs/llama_finetune.yaml --model.model_path /models/llama --data.source /data/train.jsonl
#
# With ETCD_MEMBERS=node0,node1,node2 (three or five machines of the job, the same list everywhere) the
# fail_stop store is an etcd cluster instead, with one member on each machine named there, started here
# by this script (`python -m resihp_lightning.resilience.etcd_member`: etcd named after this machine,
# listening on its address only, data in ETCD_DATA_DIR, default $TMPDIR/resihp-etcd-<JOB_ID>-<name>):
# losing any one machine, the first included, loses no store. The first machine of the list then makes
# the job's etcd user (`python -m resihp_lightning.resilience.etcd_admin`, random passwords in RUN_DIR,
# mode 0600) and the others wait for it (ETCD_WAIT_S, default 120). This machine's member stops
# ETCD_LINGER_S (default 30) after its processes have ended (another machine's may still be finishing;
# SIGTERM, then SIGKILL after 10 s) and its data directory is removed. Needs etcd (Debian: apt-get install etcd-server) on those machines;
# ETCD_ADDRESS overrides the address the member listens on (by default what its name resolves to).
#
# Every machine needs a distinct hostname that the others resolve (or RESIHP_NODE_NAME set to such a
# name). The command ends when this machine's processes have: status 0 if one of them finished the
# job (a process that died and was recovered around does not fail the job), else the first failure.
# A dead process is not restarted: the job goes on without it (docs/machines.md).
#
# A replacement machine joins the running job with the same command and JOIN=1 (the same variables
# and arguments as the job's machines, RUN_DIR and JOB_ID included):
#
#   JOIN=1 RANKS_HOST=node0 NNODES=3 NPROC=8 RUN_DIR=/shared/runs/llama examples/torchrun_per_process.sh --config ...
#
# Its NPROC processes start with RESIHP_JOIN=1: they register in no rank store (it ended at start-up),
# find the job's fail_stop store (the TCP store host on RANKS_HOST, or STORE_HOST if the first machine in
# name order is another one; or the etcd members), take ranks above every rank the job has had, and the
# job admits them as hot spares at a step boundary; its next plan uses them (docs/machines.md). With
# ETCD_MEMBERS a joining machine starts no etcd member and makes no user, even when its name is in the
# list (a replacement for a lost member's machine): it is a client of the members that run on, which
# keep their quorum while at most one of three (two of five) is lost.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${RANKS_HOST:?set RANKS_HOST to the machine that hosts the rank store}"
: "${NNODES:?set NNODES to the number of machines}"
: "${RUN_DIR:?set RUN_DIR to a directory every machine sees}"
NPROC=${NPROC:-1}
PYTHON=${PYTHON:-python}
export RESIHP_RANKS_AT="$RANKS_HOST:${RANKS_PORT:-29500}" RESIHP_WORLD_SIZE=$((NNODES * NPROC))
export RESIHP_NPROC_PER_NODE="$NPROC" RESIHP_JOB_ID="${JOB_ID:-resihp}"
JOIN=${JOIN:-0}
case "$JOIN" in
    0) ;;
    1) export RESIHP_JOIN=1 RESIHP_MASTER_ADDR="${STORE_HOST:-$RANKS_HOST}" ;;
    *) echo "JOIN=$JOIN: allowed are 1 (this machine joins the running job) or 0 (default)" >&2; exit 2 ;;
esac
mkdir -p "$RUN_DIR"
store=(--strategy.fail_stop.store_port "${STORE_PORT:-29600}")
etcd_pid=""
if [ -n "${ETCD_MEMBERS:-}" ] && [ "$JOIN" = 1 ]; then
    # A newcomer is a client of the running members (their user and password file exist already).
    if [ ! -r "$RUN_DIR/etcd-job.pw" ]; then
        echo "JOIN=1 with ETCD_MEMBERS: $RUN_DIR/etcd-job.pw is missing (is the job running, with this RUN_DIR?)" >&2
        exit 2
    fi
    endpoints=$("$PYTHON" -m resihp_lightning.resilience.etcd_member --members "$ETCD_MEMBERS" --endpoints) || exit 2
    store=(--strategy.fail_stop.store.backend etcd --strategy.fail_stop.store.endpoints "[$endpoints]"
           --strategy.fail_stop.store.user job --strategy.fail_stop.store.password_file "$RUN_DIR/etcd-job.pw")
elif [ -n "${ETCD_MEMBERS:-}" ]; then
    node=${RESIHP_NODE_NAME:-$(hostname)}
    etcd_dir=${ETCD_DATA_DIR:-${TMPDIR:-/tmp}/resihp-etcd-$RESIHP_JOB_ID-$node}
    member=("$PYTHON" -m resihp_lightning.resilience.etcd_member --members "$ETCD_MEMBERS" --name "$node"
            --token "$RESIHP_JOB_ID" --data-dir "$etcd_dir")
    if [ -n "${ETCD_ADDRESS:-}" ]; then
        member+=(--address "$ETCD_ADDRESS")
    fi
    "${member[@]}" >"$RUN_DIR/etcd-$node.log" 2>&1 &
    etcd_pid=$!
    endpoints=$("$PYTHON" -m resihp_lightning.resilience.etcd_member --members "$ETCD_MEMBERS" --endpoints) || exit 2
    ready="$RUN_DIR/etcd-$RESIHP_JOB_ID.ready"
    if [ "$node" = "${ETCD_MEMBERS%%,*}" ]; then
        rm -f "$ready"
        "$PYTHON" -m resihp_lightning.resilience.etcd_admin --endpoints "$endpoints" --user job \
            --password-file "$RUN_DIR/etcd-job.pw" --root-password-file "$RUN_DIR/etcd-root.pw" || {
            kill "$etcd_pid" 2>/dev/null
            exit 1
        }
        touch "$ready"
    else
        waited=0
        while [ ! -e "$ready" ]; do
            if [ "$waited" -ge "${ETCD_WAIT_S:-120}" ]; then
                echo "the job's etcd user was not made within ${ETCD_WAIT_S:-120} s (see the first member's log)" >&2
                kill "$etcd_pid" 2>/dev/null
                exit 1
            fi
            sleep 1
            waited=$((waited + 1))
        done
    fi
    store=(--strategy.fail_stop.store.backend etcd --strategy.fail_stop.store.endpoints "[$endpoints]"
           --strategy.fail_stop.store.user job --strategy.fail_stop.store.password_file "$RUN_DIR/etcd-job.pw")
fi
pids=()
for index in $(seq 0 $((NPROC - 1))); do
    RESIHP_LOCAL_INDEX=$index "${TORCHRUN:-torchrun}" --standalone --nnodes 1 --nproc-per-node 1 --max-restarts 0 \
        examples/finetune.py "$@" --run_dir "$RUN_DIR" "${store[@]}" &
    pids+=($!)
done
trap 'kill "${pids[@]}" $etcd_pid 2>/dev/null' INT TERM
first_failure=0 finished=0
for pid in "${pids[@]}"; do
    wait "$pid"
    status=$?
    if [ "$status" -eq 0 ]; then
        finished=1
    elif [ "$first_failure" -eq 0 ]; then
        first_failure=$status
    fi
done
if [ -n "$etcd_pid" ]; then
    sleep "${ETCD_LINGER_S:-30}"
    # SIGTERM hands a leader's role on; a member left without a quorum can hang in its shutdown: then SIGKILL.
    kill "$etcd_pid" 2>/dev/null
    for _ in $(seq 1 20); do
        kill -0 "$etcd_pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -9 "$etcd_pid" 2>/dev/null
    wait "$etcd_pid" 2>/dev/null
    rm -rf "$etcd_dir"
fi
if [ "$finished" -eq 1 ]; then
    exit 0
fi
exit "$first_failure"
