"""Restart benchmark: a lost machine under torchrun, kill -> first step after the restart; checkpoint writes.

**Restart** (``--repeats`` runs): four torchrun agents on this machine, one process each, ``--nnodes
3:4``, c10d rendezvous on localhost, run ``examples/finetune.py`` with ``examples/configs/elastic_cpu.yaml``
(the demo's model, 2 x 2, a checkpoint every 5 steps, asynchronous). After step ``--kill-step`` the last
agent and its worker are SIGKILLed. From the events log, ``steps.jsonl`` and the clock all processes
of the machine share:

* detection: kill -> the first survivor's ``worker_failed`` (its collective with the dead process broke);
* rendezvous: -> the first restarted process exists (agents notice the failure, stop their workers, the
  dead agent's keep-alive lapses, the round closes after ``last_call_timeout``, processes are spawned);
* start-up: process start -> ``ElasticRestart.setup`` (Python, torch / Lightning / DeepSpeed imports, the
  dataset, the model, the Trainer, the process group);
* planning: reading the checkpoint's saved state and the planner's plan for 3 (``plan_s`` + ``read_s``);
* checkpoint load: the strategy builds the pipeline under the new plan, Lightning reads the file and
  restores the model, optimizer, loops and callbacks (-> ``on_train_start``);
* first step: the resumed step itself.
Lost work (the steps between the checkpoint and the kill, redone) is reported apart.

**Checkpoint writes** (``--write-repeats``): the demo (Lightning's launcher, 4 processes) for
``--write-steps`` steps with a checkpoint every ``--every`` steps, synchronous, asynchronous and off,
interleaved; median step wall time of the steps that follow a save (where its cost lands) and of the
others. Then, in this process, one demo-size checkpoint written synchronously (``TorchCheckpointIO``)
and through ``AsyncCheckpointIO`` (the time the caller is blocked, and until the write is on disk).

Run: ``python benchmarks/restart.py [--repeats 2] [--write-repeats 1]`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "finetune.py"
ELASTIC = ROOT / "examples" / "configs" / "elastic_cpu.yaml"
DEMO = ROOT / "examples" / "configs" / "demo_cpu.yaml"
TORCHRUN = Path(sys.executable).with_name("torchrun")
KEEP_ALIVE_S, KEEP_ALIVE_TRIES, LAST_CALL_S = 1, 2, 1


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop("RESIHP_RUN_DIR", None)
    return env


def _jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def restart_once(kill_step: int, steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="resihp-restart-"))
    port = _free_port()
    agents: list[subprocess.Popen] = []
    workers: set[int] = set()
    try:
        for i in range(4):
            conf = (f"is_host={'true' if i == 0 else 'false'},last_call_timeout={LAST_CALL_S},"
                    f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_TRIES},join_timeout=120")
            cmd = [str(TORCHRUN), "--nnodes", "3:4", "--nproc-per-node", "1", "--max-restarts", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
                   "--rdzv-conf", conf, "--monitor-interval", "0.1", str(SCRIPT), "--config", str(ELASTIC),
                   "--run_dir", str(run_dir), "--trainer.max_steps", str(steps)]
            log = open(run_dir / f"agent{i}.log", "w")
            agents.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
            if i == 0:
                time.sleep(2)
        deadline = time.monotonic() + 600
        while not any(r["step"] >= kill_step for r in _jsonl(run_dir / "steps.jsonl")):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                raise SystemExit(f"the job did not reach step {kill_step}; see {run_dir}")
            time.sleep(0.05)
        victim = agents[3]
        doomed = _children(victim.pid)
        before = _jsonl(run_dir / "steps.jsonl")  # the restarted job starts the file anew
        killed_at = time.time()
        _kill(doomed + [victim.pid])
        for agent in agents[:3]:
            workers.update(_children(agent.pid))
            agent.wait(600)
        if any(a.returncode for a in agents[:3]):
            raise SystemExit(f"an agent failed; see {run_dir}")
    finally:
        for agent in agents:
            workers.update(_children(agent.pid))
        _kill(list(workers) + [a.pid for a in agents])
    events = _jsonl(run_dir / "events.jsonl")
    failed = min(e["at"] for e in events if e["event"] == "worker_failed")
    restart = next(e for e in events if e["event"] == "job_restarted")
    plan = next(e for e in events if e["event"] == "plan_applied" and e.get("reason") == "restart")["plan"]
    records = _jsonl(run_dir / "steps.jsonl")
    resumed = next(r for r in records if r["step"] == restart["checkpoint_step"] and r["time"] > killed_at)
    healthy = statistics.median(r["wall_ms"] for r in before[2:]) / 1000.0
    row = {
        "detection": failed - killed_at,
        "rendezvous": restart["process_started_at"] - failed,
        "startup": restart["setup_at"] - restart["process_started_at"],
        "planning": restart["read_s"] + restart["plan_s"],
        "load": restart["resumed_at"] - restart["setup_at"] - restart["read_s"] - restart["plan_s"],
        "load_engine_and_read": restart["loaded_at"] - restart["setup_at"] - restart["read_s"] - restart["plan_s"],
        "load_restore": restart["resumed_at"] - restart["loaded_at"],
        "first_step": resumed["time"] - restart["resumed_at"],
        "kill_to_first_step": resumed["time"] - killed_at,
        "lost_steps": max(r["step"] for r in before) + 1 - restart["checkpoint_step"],
        "healthy_step": healthy,
        "plan": f"{plan['pipeline_degree']}x{plan['data_degree']}",
        "checkpoint_step": restart["checkpoint_step"],
    }
    print(f"restart: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})}", flush=True)
    return row


def _demo(run_dir: Path, steps: int, every: int, mode: str) -> list[dict]:
    args = ["--config", str(DEMO), "--run_dir", str(run_dir), "--trainer.progress_bar", "false", "--fault", "null",
            "--replan", "false", "--data.max_tokens", "400000", "--trainer.max_steps", str(steps)]
    if mode == "off":
        args += ["--checkpoint", "null"]
    else:
        args += ["--checkpoint", json.dumps({"every_n_steps": every, "keep_last": 2, "asynchronous": mode == "async"})]
    result = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"the demo failed:\n{result.stderr[-3000:]}")
    return _jsonl(run_dir / "steps.jsonl")


def write_overhead(repeats: int, steps: int, every: int) -> dict[str, dict[str, list[float]]]:
    """Per mode and run: median step wall (s) of the steps right after a save (``after``), of the others
    (``other``), and their difference (``extra``: what a save adds to a step, within one run, so that
    the load of a shared machine, which moves whole runs, cancels out). Steps 3.. only."""
    out: dict[str, dict[str, list[float]]] = {m: {"after": [], "other": [], "extra": []} for m in ("off", "sync", "async")}
    for _ in range(repeats):
        for mode in ("sync", "async", "off"):
            records = _demo(Path(tempfile.mkdtemp(prefix=f"resihp-ckpt-{mode}-")), steps, every, mode)
            # A save runs at the end of step k (global step k + 1 a multiple of `every`) and shows in the
            # wall time of step k + 1, which spans from the end of step k to the end of step k + 1.
            after = [r["wall_ms"] / 1000.0 for r in records[3:] if r["step"] % every == 0]
            other = [r["wall_ms"] / 1000.0 for r in records[3:] if r["step"] % every != 0]
            a, o = statistics.median(after), statistics.median(other)
            out[mode]["after"].append(a)
            out[mode]["other"].append(o)
            out[mode]["extra"].append(a - o)
            print(f"{mode}: after a save {a:.3f} s, other steps {o:.3f} s, extra {a - o:+.3f} s", flush=True)
    return out


def write_time(repeats: int = 7) -> dict[str, float]:
    """One demo-size checkpoint (model + AdamW state + callbacks) written sync and async, in this process."""
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

    sys.path.insert(0, str(ROOT))
    import yaml

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models.hf_checkpoint import build_pipeline_model, tiny_config

    scratch = yaml.safe_load(DEMO.read_text())["model"]["scratch"]
    model = build_pipeline_model(tiny_config(**{**vars(ScratchModelConfig()), **scratch}), seed=0)
    state = {f"layers.{i}.{k}": v.detach().clone() for i, layer in enumerate(model.layers)
             for k, v in layer.state_dict().items()}
    optim = {f"{k}": {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v), "step": torch.tensor(1.0)}
             for k, v in state.items() if v.is_floating_point()}
    checkpoint = {"state_dict": state, "optimizer_states": [{"state": optim}], "global_step": 10}
    folder = Path(tempfile.mkdtemp(prefix="resihp-write-"))
    sync_s, blocked_s, async_total_s = [], [], []
    size = 0
    for i in range(repeats):
        path = folder / f"sync{i}.ckpt"
        start = time.perf_counter()
        TorchCheckpointIO().save_checkpoint(checkpoint, path)
        sync_s.append(time.perf_counter() - start)
        size = path.stat().st_size
        plugin = AsyncCheckpointIO(TorchCheckpointIO())
        start = time.perf_counter()
        plugin.save_checkpoint(checkpoint, folder / f"async{i}.ckpt")
        blocked_s.append(time.perf_counter() - start)
        plugin.teardown()
        async_total_s.append(time.perf_counter() - start)
    return {"mib": size / 2**20, "sync": statistics.median(sync_s), "async_blocked": statistics.median(blocked_s),
            "async_on_disk": statistics.median(async_total_s), "sync_min": min(sync_s),
            "async_blocked_min": min(blocked_s), "async_on_disk_min": min(async_total_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=7)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--write-repeats", type=int, default=1)
    parser.add_argument("--write-steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--only", choices=("restart", "write"), default=None)
    args = parser.parse_args()
    if args.only in (None, "write"):
        w = write_time()
        print(f"\ndemo checkpoint {w['mib']:.1f} MiB, median [min] of 7: sync write {w['sync']:.3f} [{w['sync_min']:.3f}] s; "
              f"async: caller blocked {w['async_blocked']:.3f} [{w['async_blocked_min']:.3f}] s, on disk after "
              f"{w['async_on_disk']:.3f} [{w['async_on_disk_min']:.3f}] s")
        if args.write_repeats:
            out = write_overhead(args.write_repeats, args.write_steps, args.every)
            print(f"\n| checkpoints (median of {args.write_repeats} runs) | step after a save | other steps | "
                  "extra per save (same run) |")
            print("|---|---|---|---|")
            for mode, runs in out.items():
                print(f"| {mode} | {statistics.median(runs['after']):.3f} s | {statistics.median(runs['other']):.3f} s "
                      f"| {statistics.median(runs['extra']):+.3f} s |")
    if args.only in (None, "restart"):
        rows = [restart_once(args.kill_step, args.steps) for _ in range(args.repeats)]
        keys = ("detection", "rendezvous", "startup", "planning", "load", "first_step", "kill_to_first_step")
        print(f"\n| median of {len(rows)} | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        print("| seconds | " + " | ".join(f"{statistics.median(r[k] for r in rows):.3f}" for k in keys) + " |")
        print(f"load = engine build + file read {statistics.median(r['load_engine_and_read'] for r in rows):.3f} s "
              f"+ restore {statistics.median(r['load_restore'] for r in rows):.3f} s; plan after restart "
              f"{rows[0]['plan']}; lost steps {[r['lost_steps'] for r in rows]}; healthy step (4 procs) "
              f"{statistics.median(r['healthy_step'] for r in rows):.3f} s")


if __name__ == "__main__":
    main()
