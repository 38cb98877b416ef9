"""``resilience.store``: the rendezvous store, opened by two ranks around one store host process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from resihp_lightning.resilience.procs import ProcessIdentity
from resihp_lightning.resilience.store import StoreConfig


@pytest.mark.multiprocess
@pytest.mark.parametrize("start_method", ["exec", "fork"])
def test_a_fixed_port_store_host_is_started_once_shared_and_ends_after_everyone_left(tmp_path: Path, start_method):
    from resihp_lightning.testing.harness import free_port
    from resihp_lightning.resilience.store import LOG_FILE, RendezvousStore, read_address

    config = StoreConfig(run_dir=str(tmp_path), run_id="unit", port=free_port(), host="127.0.0.1", linger_s=0.3,
                         start_method=start_method)
    ours, theirs = os.pipe()  # open in the process that starts the host: the host must not hold it
    try:
        first = RendezvousStore(config, rank=0).open()
    finally:
        os.close(theirs)
    second = RendezvousStore(StoreConfig(**{**vars(config), "spawn": False}), rank=1).open()
    try:
        assert first.address == second.address == ("127.0.0.1", config.port)
        host = ProcessIdentity(**read_address(tmp_path)["identity"])
        assert host.alive() and host.pid != os.getpid()
        assert os.getsid(host.pid) != os.getsid(0)  # a session of its own
        assert os.read(ours, 1) == b""  # end of file: no writer left, the host holds none of our files
        assert "store_host[" in (tmp_path / LOG_FILE).read_text()  # its own logging, into its log
        first.control.set("hello", "from 0")
        assert second.control.get("hello") == b"from 0"
        assert first.namespace == "resihp/unit/a0"
        first.close()
        time.sleep(0.8)
        assert host.alive()  # rank 1 has not left
        second.close()
        deadline = time.monotonic() + 5
        while host.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not host.alive(), "the store host outlived its members"
    finally:
        os.close(ours)
        first.close()
        second.close()
