"""``fail_stop.store``: the store backend's options, checked by name, and the world config they make."""

from __future__ import annotations

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.failstop.fail_stop_config import FailStopConfig, StoreOptions


def test_the_default_store_is_the_signed_tcp_host_and_etcd_is_chosen_by_option():
    default = FailStopConfig().world_config("gloo", 30.0).store
    assert default.etcd is None and default.authenticate and default.port is None and default.spawn

    endpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"]
    config = FailStopConfig.from_value({"store": {"backend": "etcd", "endpoints": endpoints, "user": "job",
                                                  "password_file": "/shared/job.pw", "op_timeout_s": 4.0}})
    assert isinstance(config.store, StoreOptions)
    store = config.world_config("gloo", 30.0, node_rank=2).store
    assert store.etcd.endpoints == tuple(endpoints) and store.etcd.user == "job" and store.etcd.op_timeout_s == 4.0
    assert store.resolved_secret_file() is None, "etcd authenticates through its own users"

    fixed = FailStopConfig(store={"port": 29600, "secret_file": "/shared/s"}).world_config("gloo", 30.0, node_rank=1).store
    assert (fixed.port, fixed.spawn, str(fixed.resolved_secret_file())) == (29600, False, "/shared/s")
    assert FailStopConfig(store_port=29600).world_config("gloo", 30.0).store.resolved_secret_file() is None


@pytest.mark.parametrize(("store", "pattern"), [
    ({"backend": "zookeeper"}, r"`fail_stop.store.backend`; allowed: 'tcp', 'etcd'"),
    ({"backend": "etcd"}, r"`fail_stop.store.endpoints`; allowed: a non-empty list"),
    ({"backend": "etcd", "endpoints": ["ftp://a"]}, r"`fail_stop.store.endpoints`; allowed: http://host:port"),
    ({"backend": "etcd", "endpoints": ["http://a:2379"], "user": "job"}, r"`fail_stop.store.password_file`"),
    ({"backend": "etcd", "endpoints": ["http://a:2379"], "port": 1}, r"`fail_stop.store.port`; allowed: null with backend 'etcd'"),
    ({"backend": "etcd", "endpoints": ["http://a:2379"], "op_timeout_s": 0}, r"`fail_stop.store.op_timeout_s`"),
    ({"endpoints": ["http://a:2379"]}, r"`fail_stop.store.endpoints`; allowed: null with backend 'tcp'"),
    ({"port": 70000}, r"`fail_stop.store.port`"),
    ({"authenticate": "yes"}, r"`fail_stop.store.authenticate`; allowed: true or false"),
    ({"hosts": ["a"]}, r"`fail_stop.store.hosts`"),
    ("etcd", r"`fail_stop.store`; allowed: a mapping"),
])
def test_bad_store_options_are_named(store, pattern):
    with pytest.raises(ConfigError, match=pattern):
        FailStopConfig.from_value({"store": store})


def test_store_port_and_an_etcd_store_exclude_each_other():
    with pytest.raises(ConfigError, match="`fail_stop.store_port`"):
        FailStopConfig(store_port=29600, store={"backend": "etcd", "endpoints": ["http://a:2379"]})


def test_several_machines_need_a_fixed_store_port_or_etcd_and_a_detector_that_ends_a_cut_off_process():
    """What ResiHPStrategy checks on several machines (it refused the etcd store before: only store_port counted),
    and the stall bound of a process that lost the store: the join timeout."""
    etcd = {"backend": "etcd", "endpoints": ["http://node0:2379", "http://node1:2379", "http://node2:2379"]}
    assert [FailStopConfig(**options).spans_machines for options in (
        {}, {"store_port": 29600}, {"store": {"port": 29600}}, {"store": etcd})] == [False, True, True, True]
    config = FailStopConfig(store=etcd, join_timeout_s=12.0)
    assert config.world_config("gloo", 30.0).detector.stall_timeout_s == 12.0
