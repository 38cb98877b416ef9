#!/usr/bin/env bash
# Several machines, a death recovered in-process under torchrun: run this same command on every machine.
#
# It starts NPROC processes here, each under a torchrun agent of its own (`torchrun --standalone
# --nproc-per-node 1 --max-restarts 0`), so no agent restarts or tears down another's process when one
# dies: the job's fail_stop recovery handles every death. The ranks come from a small store on
# RANKS_HOST (resihp_lightning.process_ranks; needed only at start). The job's fail_stop store runs on
# the first machine in name order at STORE_PORT.
#
#   RANKS_HOST=node0 NNODES=3 NPROC=8 RUN_DIR=/shared/runs/llama examples/torchrun_per_process.sh \
#       --config examples/configs/llama_finetune.yaml --model.model_path /models/llama --data.source /data/train.jsonl
#
# Every machine needs a distinct hostname that the others resolve (or RESIHP_NODE_NAME set to such a
# name). The command ends when this machine's processes have: status 0 if one of them finished the
# job (a process that died and was recovered around does not fail the job), else the first failure.
# A dead process is not restarted: the job goes on without it (docs/machines.md).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${RANKS_HOST:?set RANKS_HOST to the machine that hosts the rank store}"
: "${NNODES:?set NNODES to the number of machines}"
NPROC=${NPROC:-1}
export RESIHP_RANKS_AT="$RANKS_HOST:${RANKS_PORT:-29500}" RESIHP_WORLD_SIZE=$((NNODES * NPROC))
export RESIHP_NPROC_PER_NODE="$NPROC" RESIHP_JOB_ID="${JOB_ID:-resihp}"
pids=()
for index in $(seq 0 $((NPROC - 1))); do
    RESIHP_LOCAL_INDEX=$index "${TORCHRUN:-torchrun}" --standalone --nnodes 1 --nproc-per-node 1 --max-restarts 0 \
        examples/finetune.py "$@" --run_dir "${RUN_DIR:?set RUN_DIR to a directory every machine sees}" \
        --strategy.fail_stop.store_port "${STORE_PORT:-29600}" &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' INT TERM
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
if [ "$finished" -eq 1 ]; then
    exit 0
fi
exit "$first_failure"
