"""TCP stores on localhost for single-process tests of the recovery mechanism's parts."""

from __future__ import annotations

import datetime
from typing import Any


def tcp_store_server(timeout_s: float = 10.0) -> Any:
    """A ``torch.distributed.TCPStore`` master on a free port of 127.0.0.1 (its ``port`` says which)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def tcp_store_client(server: Any, timeout_s: float = 10.0) -> Any:
    """A client of ``server`` (another connection to the same store)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
