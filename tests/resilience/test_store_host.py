"""``resilience.store_host``: the store host process's life, in one process (its serve loop in a thread)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from resihp_lightning.resilience.procs import ProcessIdentity
from resihp_lightning.resilience.store import host_key
from resihp_lightning.resilience.store_host import StoreHost
from resihp_lightning.testing.stores import tcp_store_client


def test_store_host_ends_when_its_members_are_gone(tmp_path: Path):
    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = ProcessIdentity.current()
        stat = Path(f"/proc/{member.pid}/stat").read_text()
        start = int(stat[stat.rfind(")") + 2 :].split()[19])
        member_identity = ProcessIdentity(member.pid, start, identity.namespace)
        host = StoreHost(tmp_path, host="127.0.0.1", port=0, timeout_s=5, linger_s=0.3,
                         startup_timeout_s=30, remote_idle_s=30, poll_s=0.05)
        reasons: list[str] = []
        thread = threading.Thread(target=lambda: reasons.append(host.serve()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while host.store is None or not (tmp_path / "store.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client = tcp_store_client(host.store)
        client.add(host_key("count"), 1)
        client.set(host_key("member/0"), json.dumps({"rank": 0, "identity": vars(member_identity), "beat_key": "x"}))
        time.sleep(0.6)
        assert thread.is_alive()  # its member lives (longer than linger_s)
        member.kill()
        member.wait()
        killed = time.monotonic()
        thread.join(5)
        assert reasons == ["no member left"]
        assert time.monotonic() - killed < 2.0
        assert not (tmp_path / "store.json").exists()
    finally:
        member.kill()
        member.wait()
