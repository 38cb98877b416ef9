"""``resilience.etcd_gateway``: which member a connection tries first (no etcd needed: nothing is sent).

With one etcd member per machine, each process should talk to its own machine's member: when another
machine is lost (machine 0 cut off, say), its processes then lose no request to the lost member and pay
no failover. A new connection (a generation's store client) starts at the member the connection it was
cloned from reaches now, not at the lost one again.
"""

from __future__ import annotations

import datetime

from resihp_lightning.resilience.etcd_gateway import Endpoint, EtcdGateway, local_member

#: TEST-NET-3 and TEST-NET-2 (RFC 5737, documentation only): addresses of no machine here.
ELSEWHERE = "http://203.0.113.7:2379"
ELSEWHERE_TOO = "http://198.51.100.7:2379"


def test_a_connection_first_tries_the_member_on_its_own_machine():
    assert EtcdGateway([ELSEWHERE, "http://127.0.0.1:2379", ELSEWHERE_TOO]).endpoint.host == "127.0.0.1"
    assert EtcdGateway([ELSEWHERE, ELSEWHERE_TOO]).endpoint.host == "203.0.113.7"  # none here: the first
    assert EtcdGateway([ELSEWHERE, "http://localhost:2379"]).endpoint.host == "localhost"  # a name of this machine
    assert EtcdGateway([ELSEWHERE, "http://127.0.0.1:2379"], start=0).endpoint.host == "203.0.113.7"
    assert local_member((Endpoint.parse("http://no-such-host.invalid:2379"), Endpoint.parse(ELSEWHERE))) == 0


def test_a_clone_starts_at_the_member_its_origin_reaches_now():
    from resihp_lightning.resilience.etcd_config import EtcdConfig
    from resihp_lightning.resilience.etcd_store import EtcdStore

    config = EtcdConfig(endpoints=("http://127.0.0.1:2379", ELSEWHERE, ELSEWHERE_TOO))
    store = EtcdStore(config, root="", timeout=datetime.timedelta(seconds=1))
    assert store.gateway.endpoint.host == "127.0.0.1"
    store.gateway._next_member()  # as after a failed request
    assert store.clone().gateway.endpoint == store.gateway.endpoint == Endpoint.parse(ELSEWHERE)
