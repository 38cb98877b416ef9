#!/usr/bin/env bash
# Rehearse an elastic job on one machine: 4 torchrun agents with one process each stand for 4
# machines (--nnodes 3:4); c10d rendezvous on localhost. KILL_AFTER=<seconds> kills the last agent
# and its worker then, as a machine dies: the other three restart the job from its newest checkpoint
# under a plan for 3 (events.jsonl: worker_failed, job_restarted, plan_applied).
#
#   examples/torchrun_one_machine.sh                     # 4 "machines", runs to the end
#   KILL_AFTER=60 examples/torchrun_one_machine.sh       # lose one a minute in
#
# Without torchrun, one machine needs no launcher at all: `python examples/finetune.py --config
# examples/configs/demo_cpu.yaml --run_dir runs/demo` (Lightning starts the processes; a lost rank is
# recovered in-process; rerunning the same command resumes from runs/demo/checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
PORT=${PORT:-29400}
RUN_DIR=${RUN_DIR:-runs/elastic-one-machine}
CONFIG=${CONFIG:-examples/configs/elastic_cpu.yaml}
# torch 2.13 shares the agent's store with the workers across restarts, where they can read their
# predecessors' addresses; each round gets a fresh store with this (resihp_lightning/launcher_env.py).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1
mkdir -p "$RUN_DIR"
pids=()
for i in 0 1 2 3; do
  host=false; [ "$i" = 0 ] && host=true   # agent 0 hosts the rendezvous store: do not kill that one
  # last_call_timeout: how long a round waits for more than MIN nodes; keep_alive_*: a silent agent
  # leaves the rendezvous after interval x attempts seconds (torch's defaults: 30 s and 5 s x 3).
  setsid "$TORCHRUN" --nnodes 3:4 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \
      --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id resihp-one-machine --monitor-interval 0.5 \
      --rdzv-conf "is_host=$host,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3" \
      examples/finetune.py --config "$CONFIG" --run_dir "$RUN_DIR" > "$RUN_DIR/agent$i.log" 2>&1 &
  pids+=($!)
  [ "$i" = 0 ] && sleep 2
done
trap 'kill -9 -- "${pids[@]/#/-}" 2>/dev/null || true' EXIT
if [ -n "${KILL_AFTER:-}" ]; then
  sleep "$KILL_AFTER"
  victim=${pids[3]}
  echo "killing agent $victim and its worker(s)"
  pkill -9 -P "$victim" || true   # the worker (a child of the agent)
  kill -9 "$victim"
fi
status=0
for pid in "${pids[@]:0:3}"; do wait "$pid" || status=$?; done
echo "done (status $status); events: $RUN_DIR/events.jsonl"
exit $status
