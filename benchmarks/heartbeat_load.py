"""Heartbeat load on the store: two-level detection vs. every process watching every other one.

Simulates R ranks on M machines in this one process: one real
:class:`~resihp_lightning.resilience.failure_detector.FailureDetector` per rank, each with a store
connection of its own to one real ``TCPStore`` and an identity on its simulated machine
(:meth:`~resihp_lightning.resilience.procs.ProcessIdentity.simulated`; the ranks of a machine share
this process, so they are alive to each other through ``/proc``, and the machines' boards are real
directories). No training runs. Instead of letting 1024 threads fight over two cores, every rank's
poll runs in turn (a *round* = one poll of every rank, what the store sees per ``interval_s``), and
each store operation is counted with the bytes of its keys and values (request and response payload,
key prefix and framing not counted).

* ``two-level``: the detectors as they run (``probe_local_pids`` on): per round, each machine's
  monitor writes its machine's beat, reads the other machines' beats and checks the abort marker;
  the other processes use the machine's board (files), not the store;
* ``all-to-all``: ``probe_local_pids`` off, the detectors' path for peers they cannot place, which
  is what every process did before the two levels: each writes its beat, reads every peer's beat in
  one ``multi_get`` and checks the abort marker.

Run: ``python benchmarks/heartbeat_load.py [--layouts 1024x128,64x8,4x1] [--rounds 5]``; prints a
markdown table (per round and per second at the default interval of 0.2 s).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.resilience.failure_detector import FailureDetector, FailureDetectorConfig  # noqa: E402
from resihp_lightning.resilience.procs import ProcessIdentity  # noqa: E402

INTERVAL_S = 0.2


def _size(value: object) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8  # a number


class CountingStore:
    """A store connection that counts operations and payload bytes (shared totals across connections)."""

    totals = {"ops": 0, "bytes": 0}

    def __init__(self, store: object) -> None:
        self._store = store

    def __getattr__(self, name: str):
        operation = getattr(self._store, name)

        def call(*args, **kwargs):
            result = operation(*args, **kwargs)
            CountingStore.totals["ops"] += 1
            CountingStore.totals["bytes"] += _size(list(args)) + _size(result if result is not None else b"")
            return result

        return call


def measure(ranks: int, machines: int, two_level: bool, rounds: int, warmup: int = 3) -> dict[str, float]:
    """Store operations and bytes per round of ``ranks`` detectors on ``machines`` simulated machines."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    config = FailureDetectorConfig(interval_s=INTERVAL_S, timeout_s=1.0, probe_local_pids=two_level)
    per_machine = ranks // machines
    detectors = []
    for rank in range(ranks):
        def connect() -> CountingStore:
            client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=60))
            return CountingStore(dist.PrefixStore(f"bench{int(two_level)}", client))

        detector = FailureDetector(config, rank=rank, connect=connect, on_abort_marker=lambda *_: None,
                                   identity=ProcessIdentity.simulated(f"m{rank // per_machine}"))
        detector.start()
        detector.stop()  # no thread: the rounds below poll each rank in turn
        detector.watch(range(ranks), 0)
        detectors.append(detector)
    for _ in range(warmup):  # identities read, boards stamped
        for detector in detectors:
            detector._tick()
    CountingStore.totals.update(ops=0, bytes=0)
    started = time.perf_counter()
    for _ in range(rounds):
        for detector in detectors:
            detector._tick()
    row = {"ops": CountingStore.totals["ops"] / rounds, "bytes": CountingStore.totals["bytes"] / rounds,
           "seconds": (time.perf_counter() - started) / rounds, "failed": sum(len(d.failed) for d in detectors)}
    for detector in detectors:
        detector.stop(goodbye=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="1024x128,64x8,4x1", help="RANKSxMACHINES, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="all-to-all,two-level", help="which detection to measure")
    args = parser.parse_args(argv)
    print("| ranks | machines | detection | store ops / round | ops / s at 0.2 s | payload KB / round | MB / s | "
          "poll round s (1 process) | verdicts |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        ranks, machines = (int(x) for x in layout.split("x"))
        for mode in args.modes.split(","):
            two_level = mode == "two-level"
            row = measure(ranks, machines, two_level, args.rounds)
            print(f"| {ranks} | {machines} | {mode} | {row['ops']:.0f} | "
                  f"{row['ops'] / INTERVAL_S:.0f} | {row['bytes'] / 1e3:.1f} | {row['bytes'] / INTERVAL_S / 1e6:.2f} | "
                  f"{row['seconds']:.2f} | {row['failed']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
