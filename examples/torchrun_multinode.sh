#!/usr/bin/env bash
# Several machines with torchrun, the restart recipe: run this same command on every machine (no node
# rank: the c10d rendezvous deals ranks). Between MIN_NODES and MAX_NODES machines form the job; when
# one is lost the others restart from the newest checkpoint in the shared RUN_DIR under a plan for the
# machines left, at most MAX_RESTARTS times. RDZV_HOST hosts the rendezvous store (its loss ends the
# job: put it on the most reliable machine, or use an etcd rendezvous). fail_stop is off (every loss
# takes the restart path; under one torchrun agent per machine an in-process recovery would be torn
# down by the agents, docs/machines.md): for recovery without a restart use
# examples/torchrun_per_process.sh. examples/slurm_finetune.sbatch runs this script under srun.
#
#   RDZV_HOST=node0 MIN_NODES=3 MAX_NODES=4 NPROC=8 RUN_DIR=/shared/runs/llama examples/torchrun_multinode.sh \
#       --config examples/configs/llama_finetune.yaml --model.model_path /models/llama --data.source /data/train.jsonl
#
# Trainer(num_nodes, devices) follow torchrun's world each round (resihp_lightning.launcher_env.launcher_shape):
# num_nodes = WORLD_SIZE / LOCAL_WORLD_SIZE, devices = --nproc-per-node.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RDZV_HOST:?set RDZV_HOST to the machine that hosts the rendezvous}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
CHECKPOINT=${CHECKPOINT:-'{"every_n_steps": 50, "keep_last": 3}'}
exec "${TORCHRUN:-torchrun}" --nnodes "${MIN_NODES:-1}:${MAX_NODES:-1}" --nproc-per-node "${NPROC:-1}" \
    --max-restarts "${MAX_RESTARTS:-3}" --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" \
    --rdzv-id "${RDZV_ID:-resihp}" --rdzv-conf "last_call_timeout=${LAST_CALL_S:-30},keep_alive_interval=5,keep_alive_max_attempt=3" \
    examples/finetune.py --strategy.fail_stop null "$@" --run_dir "${RUN_DIR:?set RUN_DIR to a directory every machine sees}" \
    --checkpoint "$CHECKPOINT"
