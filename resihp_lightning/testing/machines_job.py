"""The exactness job (:mod:`.toy_jobs`) as a torchrun worker script with ``fail_stop`` on, for the machines harness.

Every worker of every restart runs this script (``tests/machines/test_torchrun_machines.py``):
``Trainer(strategy=ResiHPStrategy(pipeline_degree=2, fail_stop=FailStopConfig(store_port=...)))`` over
the world torchrun formed (``launcher_shape``), the model of :func:`~.toy_jobs.build_class` on
:func:`~.toy_jobs.make_data`'s rows, whose one-process losses and weights :func:`~.toy_jobs.reference_fit`
computes. Each step sleeps ``--step-s`` in total inside the pipeline schedule (before each micro-batch's
forward of the rank's first layer), so that a fault injected from outside lands inside a step.

What it writes under ``--run-dir`` (``<tag>`` = ``r<restart>-<rank at start>-<pid>``):

* ``start-<tag>.json``: hostname, node rank (``GROUP_RANK``, under srun ``SLURM_NODEID``), local rank, pid,
  ``MASTER_ADDR``, when, whether it joined the running job;
* ``steps-<tag>.jsonl``: one line per finished step (step, loss, world size, whether this process was a
  spare, the devices of the plan in force, time);
* ``result-<tag>.json``: at the end of ``fit``, the losses, the final weights and the last recovery.

A newcomer (``RESIHP_JOIN=1``: a replacement that joins the running job) learns its rank from the job's
store once its strategy has set up: its tag (with that rank) and start record are written then.
``--newcomers-at STEP --newcomers N`` makes the job's own processes wait at the start of ``STEP`` until
``N`` newcomers have registered (bounded), so that the step that admits them is fixed (the members admit
newcomers at the step after the commit that counted them; the plan after that uses them).

    torchrun --nnodes 3 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 \\
        resihp_lightning/testing/machines_job.py --run-dir RUN --store-port 29600

or, with the store on the machines' etcd members (``--store '{"backend": "etcd", "endpoints": [...]}'``). It
also takes the options ``examples/slurm_in_process.sbatch`` gives ``examples/finetune.py`` (``--run_dir``,
``--strategy.fail_stop.store_port`` or ``--strategy.fail_stop.store.*``; ``--config``, ``--trainer.accelerator``
and ``--checkpoint`` are ignored), so that the recipe runs it with ``SCRIPT=resihp_lightning/testing/machines_job.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _record(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", "--run_dir", required=True)
    parser.add_argument("--store-port", "--strategy.fail_stop.store_port", type=int, default=None,
                        help="fail_stop.store_port (the TCP store host on node 0)")
    parser.add_argument("--store", default=None, help="fail_stop.store as JSON (e.g. the etcd members), instead of --store-port")
    parser.add_argument("--join-timeout-s", type=float, default=30.0, help="fail_stop.join_timeout_s")
    parser.add_argument("--steps", type=int, default=6, help="one epoch is toy_jobs.EPOCH_STEPS")
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep this long inside each step, in all")
    parser.add_argument("--detect-timeout-s", type=float, default=1.0)
    parser.add_argument("--pipeline-degree", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="collective timeout (ResiHPStrategy(timeout=...))")
    parser.add_argument("--newcomers-at", type=int, default=-1, help="the job's processes wait at the start of this step")
    parser.add_argument("--newcomers", type=int, default=0, help="... until this many newcomers have registered")
    parser.add_argument("--newcomers-wait-s", type=float, default=180.0, help="... at most this long")
    # What examples/slurm_in_process.sbatch passes examples/finetune.py (SCRIPT=<this file> runs this job instead):
    # the store's options as the example spells them; its config, accelerator and checkpoints mean nothing here.
    for name in ("backend", "endpoints", "user", "password_file"):
        parser.add_argument(f"--strategy.fail_stop.store.{name}", dest=f"etcd_{name}", default=None)
    for name in ("--config", "--trainer.accelerator", "--checkpoint"):
        parser.add_argument(name, default=None, help="ignored (an option of examples/finetune.py)")
    args = parser.parse_args(argv)
    if args.etcd_backend is not None:
        args.store = json.dumps({"backend": args.etcd_backend, "endpoints": args.etcd_endpoints.strip("[]").split(","),
                                 "user": args.etcd_user, "password_file": args.etcd_password_file})

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks.failstop.failstop_reporter import FailStopReporter
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.launcher_env import launcher_shape, restart_count
    from resihp_lightning.process_ranks import ensure_process_ranks, joins
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import M, MBS, build_class, make_data

    torch.set_num_threads(1)
    # One torchrun --standalone agent per process (RESIHP_RANKS_AT set): the job's ranks before anything reads them.
    ensure_process_ranks()
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The pid too: after a membership change torchrun restarts the other agents' workers with the same count.
    env = os.environ
    newcomer = joins()

    def start_record(rank: object) -> str:
        tag = f"r{restart_count()}-{rank}-{os.getpid()}"
        _record(run_dir / f"start-{tag}.json", {
            "host": socket.gethostname(), "node_rank": int(env.get("GROUP_RANK", env.get("SLURM_NODEID", "0"))),
            "local_rank": int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))), "pid": os.getpid(),
            "master_addr": os.environ.get("MASTER_ADDR"), "time": time.time(), "monotonic": time.monotonic(),
            "joined": newcomer,
        })
        return tag

    # torchrun's rank, or srun's task id; a newcomer's comes from the job's store (Recorder.setup).
    tag = None if newcomer else start_record(env.get("RANK", env.get("SLURM_PROCID", "0")))

    class Recorder(pl.Callback):
        """Logs each finished step and keeps a per-micro-batch sleep hook on the rank's first layer."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self._hooked: tuple[int, object] | None = None

        def setup(self, trainer, pl_module, stage):
            nonlocal tag
            if tag is None:  # a newcomer: its rank was claimed in the strategy's setup_distributed
                tag = start_record(trainer.strategy.device_id)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if trainer.global_step == args.newcomers_at and not newcomer:
                deadline = time.monotonic() + args.newcomers_wait_s
                while strategy.newcomers_waiting() < args.newcomers and time.monotonic() < deadline:
                    time.sleep(0.05)
            layers = list(strategy.local_layers().values())
            if not args.step_s or not layers or (self._hooked and self._hooked[0] == id(layers[0])):
                return
            if self._hooked:
                self._hooked[1].remove()
            handle = layers[0].register_forward_pre_hook(lambda module, inputs: time.sleep(args.step_s / M))
            self._hooked = (id(layers[0]), handle)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = float(outputs["loss"])
            self.losses.append(loss)
            strategy = trainer.strategy
            with open(run_dir / f"steps-{tag}.jsonl", "a") as handle:
                handle.write(json.dumps({"step": trainer.global_step - 1, "loss": loss, "world": trainer.world_size,
                                         "spare": strategy.is_spare, "devices": sorted(strategy.current_plan.device_ids),
                                         "time": time.time(), "monotonic": time.monotonic()}) + "\n")

    recorder = Recorder()
    num_nodes, devices = launcher_shape(devices=1, num_nodes=1)
    fail_stop = FailStopConfig(store_port=args.store_port, store=json.loads(args.store) if args.store else None,
                               detect_timeout_s=args.detect_timeout_s, join_timeout_s=args.join_timeout_s)
    strategy = ResiHPStrategy(pipeline_degree=args.pipeline_degree, micro_batch_size=MBS, fail_stop=fail_stop,
                              timeout=args.timeout_s)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=args.steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[recorder, FailStopReporter(log_dir=str(run_dir))], default_root_dir=str(run_dir),
    )
    x, y = make_data()
    model = build_class()()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=M * MBS))
    record = strategy.last_recovery
    _record(run_dir / f"result-{tag}.json", {
        "host": socket.gethostname(), "losses": recorder.losses, "time": time.time(),
        "state": {k: v.detach().tolist() for k, v in model.state_dict().items()},
        "world": trainer.world_size,
        "recovery": None if record is None else {
            "step": record.step, "generation": record.generation, "failed": {str(k): v for k, v in record.failed.items()},
            "members": list(record.members), "detected_at": record.detected_at, "total_s": record.total_s,
            "regroup_s": record.regroup_s, "redo_s": record.redo_s,
        },
    })


if __name__ == "__main__":
    main()
