"""What the fail-stop store costs per operation: etcd (3 members) against the TCP store host, same machine.

For each store, one client in this process runs the operations the failure detector and a regroup
make, ``--ops`` times each, and the script reports the client's latency (median and 95th percentile)
and the CPU time the *servers* spent per operation (``/proc/<pid>/stat`` of the server processes
before and after: the TCP store in a process of its own, the three etcd members together):

* ``heartbeat``: a machine's beat (``set`` of a 40-byte value; the two-level detector writes one
  per machine per ``interval_s``);
* ``read beats``: a monitor's read of the other machines' beats (``multi_get`` of 8 keys);
* ``abort check``: the abort marker's ``check`` (every monitor, every poll);
* ``vote``: a regroup's ``compare_set`` on a fresh key (the leader's proposal, the abort marker);
* ``join``: a regroup's ``append`` to the join list;
* ``count``: ``add`` (registrations, a reshape's quiescence).

Stores: ``tcp`` (torch's ``TCPStore``, unsigned, as with a fixed port on several machines),
``tcp-signed`` (the one-machine default: every value HMAC-signed, :mod:`resihp_lightning.resilience.store_auth`),
``etcd`` (3 members on 127.0.0.51-53, auth off) and ``etcd-auth`` (auth on, the job's user).

Run: ``python benchmarks/store_cost.py [--ops 300]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def operations(store: Any, machines: int = 8) -> dict[str, Callable[[int], Any]]:
    beats = [f"mb/{m}" for m in range(machines)]
    for key in beats:
        store.set(key, "x" * 40)
    return {
        "heartbeat": lambda i: store.set("mb/0", f"{i:08d}" + "x" * 32),
        "read beats": lambda i: store.multi_get(beats),
        "abort check": lambda i: store.check([f"gen{i}/abort"]),
        "vote": lambda i: store.compare_set(f"gen{i}/members", "", "[0,1,3]"),
        "join": lambda i: store.append("gen1/joined", f"{i % 64},"),
        "count": lambda i: store.add("count", 1),
    }


def measure(store: Any, server_pids: list[int], ops: int) -> dict[str, tuple[float, float, float]]:
    """Operation -> (median ms, p95 ms, server CPU ms per op)."""
    results = {}
    for name, op in operations(store).items():
        for i in range(20):  # warm-up (connections, leader, caches)
            op(10_000_000 + i)
        times = []
        cpu_before = cpu_s(server_pids)
        for i in range(ops):
            started = time.perf_counter()
            op(i)
            times.append(time.perf_counter() - started)
        cpu = cpu_s(server_pids) - cpu_before
        times.sort()
        results[name] = (statistics.median(times) * 1e3, times[int(0.95 * len(times))] * 1e3, cpu / ops * 1e3)
    return results


def tcp_server() -> tuple[subprocess.Popen, int]:
    """A TCPStore server in a process of its own (like the store host); its port."""
    code = (
        "import datetime, sys, time, torch.distributed as dist;"
        "s = dist.TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False);"
        "print(s.port, flush=True); time.sleep(3600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--stores", default="tcp,tcp-signed,etcd,etcd-auth")
    args = parser.parse_args()

    import torch.distributed as dist

    from resihp_lightning.resilience.etcd_admin import setup_job_user
    from resihp_lightning.resilience.etcd_config import EtcdConfig
    from resihp_lightning.resilience.etcd_store import EtcdStore
    from resihp_lightning.resilience.store_auth import SignedStore
    from resihp_lightning.testing.etcd_cluster import LocalEtcdCluster, etcd_unavailable_reason

    timeout = datetime.timedelta(seconds=30)
    wanted = args.stores.split(",")
    rows: dict[str, dict[str, tuple[float, float, float]]] = {}
    if {"tcp", "tcp-signed"} & set(wanted):
        proc, port = tcp_server()
        try:
            client = dist.TCPStore("127.0.0.1", port, None, False, timeout, wait_for_workers=False)
            if "tcp" in wanted:
                rows["tcp"] = measure(dist.PrefixStore("plain", client), [proc.pid], args.ops)
            if "tcp-signed" in wanted:
                signed = SignedStore(client, os.urandom(32))
                rows["tcp-signed"] = measure(dist.PrefixStore("signed", signed), [proc.pid], args.ops)
        finally:
            proc.kill()
            proc.wait()
    if {"etcd", "etcd-auth"} & set(wanted):
        reason = etcd_unavailable_reason()
        if reason is not None:
            print(f"etcd skipped: {reason}", file=sys.stderr)
        else:
            with tempfile.TemporaryDirectory() as tmp, LocalEtcdCluster(tmp, first=51) as cluster:
                pids = [p.pid for p in cluster.procs if p is not None]
                if "etcd" in wanted:
                    store = EtcdStore(EtcdConfig(endpoints=cluster.endpoints), root="resihp/bench/", timeout=timeout)
                    rows["etcd"] = measure(dist.PrefixStore("plain", store), pids, args.ops)
                if "etcd-auth" in wanted:
                    Path(tmp, "pw").write_text("job-password\n")
                    setup_job_user(cluster.endpoints, user="job", password="job-password", root_password="root")
                    config = EtcdConfig(endpoints=cluster.endpoints, user="job", password_file=str(Path(tmp, "pw")))
                    store = EtcdStore(config, root="resihp/bench/", timeout=timeout)
                    rows["etcd-auth"] = measure(dist.PrefixStore("auth", store), pids, args.ops)

    names = list(next(iter(rows.values())))
    print(f"{args.ops} operations each; client latency median / p95 (ms); server CPU per operation (ms)\n")
    print("| operation | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        cells = [f"{rows[s][name][0]:.2f} / {rows[s][name][1]:.2f}; cpu {rows[s][name][2]:.2f}" for s in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
