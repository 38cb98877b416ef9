"""Recovery benchmark: how long 4 gloo processes take to get over losing one of them.

Each run starts 4 processes (``resihp_lightning/testing/harness.py``) in a loop of collectives under
:class:`~resihp_lightning.resilience.world.ElasticWorld` with its default detection (0.2 s beats,
1 s silence). At step 20 the victim records ``time.monotonic()`` (one clock for all processes of a
machine) and fails. Every survivor records, on the same clock:

* **released**: its blocked collective raised and :class:`PeerFailure` was caught (the abort);
* **agreed**: the members of the next generation were agreed through the store;
* **regrouped**: the new default group is initialised and confirmed (``regroup()`` returned).

Scenarios: SIGKILL of rank 2 in an all_reduce loop; SIGKILL of rank 0 (the rank that hosts the
store in a plain Lightning job) in a pipeline-like send/recv chain; SIGKILL of ranks 1 and 2 at the
same step (timed from the first death); SIGSTOP of rank 1 in an all_reduce loop (nothing breaks
on the wire, so only the detector's silence timeout can release the survivors). Per run the median
over survivors is taken; the table shows the median over runs and, in brackets, the worst survivor
of any run.

Run: ``python benchmarks/recovery.py [--repeats 5] [--scenario NAME ...]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.testing.harness import last_words, run_job  # noqa: E402

SCENARIOS = {
    "kill-rank2-allreduce": dict(victims=(2,), kind="kill", mode="all_reduce"),
    "kill-rank0-p2p": dict(victims=(0,), kind="kill", mode="p2p"),
    "kill-ranks1+2-allreduce": dict(victims=(1, 2), kind="kill", mode="all_reduce"),
    "stop-rank1-allreduce": dict(victims=(1,), kind="stop", mode="all_reduce"),
}
FAIL_AT, STEPS = 20, 40


def _step(world, mode: str) -> None:
    import torch
    import torch.distributed as dist

    if mode == "all_reduce":
        dist.all_reduce(torch.ones(1024))
        return
    rank, size = world.rank, world.world_size
    activation = torch.zeros(1024)
    if rank > 0:
        dist.recv(activation, rank - 1)
    if rank < size - 1:
        dist.send(activation, rank + 1)
        dist.recv(activation, rank + 1)
    if rank > 0:
        dist.send(activation, rank - 1)


def _worker(rank, world_size, run_dir, *, victims, kind, mode):
    import torch
    import torch.distributed as dist

    from resihp_lightning.resilience import ElasticWorld, PeerFailure, StoreConfig, WorldConfig

    world = ElasticWorld(WorldConfig(store=StoreConfig(run_dir=run_dir), join_timeout_s=10, regroup_timeout_s=30,
                                     collective_timeout_s=60)).start()
    step, record = 0, None
    while step < STEPS:
        if rank in victims and step == FAIL_AT:
            last_words(run_dir, rank, at=time.monotonic())
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        try:
            with world.guard():
                _step(world, mode)
            step += 1
            world.progress(step)
            time.sleep(0.002)
        except PeerFailure:
            released = time.monotonic()
            world.regroup()
            formed = world.history[-1]
            record = {"released": released, "agreed": formed["agreed_at"], "regrouped": time.monotonic(),
                      "size": world.world_size}
            agreed = torch.tensor([step])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            step = int(agreed.item())
    world.close()
    return record


def _run(name: str, repeats: int) -> dict[str, list[float]]:
    spec = SCENARIOS[name]
    phases: dict[str, list[float]] = {"released": [], "agreed": [], "regrouped": []}
    worst: dict[str, float] = {k: 0.0 for k in phases}
    survivors = [r for r in range(4) if r not in spec["victims"]]
    for attempt in range(repeats):
        outcome = run_job(_worker, 4, timeout=60, wait_for=survivors, **spec)
        values = outcome.values()
        if sorted(values) != survivors or any(v is None or v["size"] != len(survivors) for v in values.values()):
            print(f"{name} run {attempt}: FAILED\n{outcome.describe()}", file=sys.stderr)
            continue
        died = min(outcome.ranks[v].last_words["at"] for v in spec["victims"])
        for phase in phases:
            delays = [v[phase] - died for v in values.values()]
            phases[phase].append(statistics.median(delays))
            worst[phase] = max(worst[phase], *delays)
    return {"median": {k: statistics.median(v) if v else float("nan") for k, v in phases.items()},
            "worst": worst, "runs": len(phases["released"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scenario", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    args = parser.parse_args()
    rows = []
    for name in args.scenario:
        started = time.monotonic()
        result = _run(name, args.repeats)
        rows.append((name, result))
        print(f"# {name}: {result['runs']}/{args.repeats} runs in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(f"\n4 gloo processes, failure at step {FAIL_AT}; seconds after it (median of runs [worst survivor])")
    print(f"{'scenario':<24} {'runs':>4} {'released':>16} {'agreed':>16} {'regrouped':>16}")
    for name, result in rows:
        cells = [f"{result['median'][k]:.3f} [{result['worst'][k]:.3f}]" for k in ("released", "agreed", "regrouped")]
        print(f"{name:<24} {result['runs']:>4} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
