"""``resilience.etcd_member``: the etcd command line of one machine's member (torch-free; etcd is not run)."""

from __future__ import annotations

import socket

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.resilience.etcd_member import EtcdMemberConfig, main


def test_the_member_is_named_after_its_machine_and_listens_on_its_address_only():
    config = EtcdMemberConfig(members=("node0", "node1", "node2"), name="node1", address="10.77.0.2", token="job7",
                              data_dir="/var/tmp/etcd-job7", extra=("--election-timeout", "500"))
    assert config.command() == [
        "etcd", "--name", "node1", "--data-dir", "/var/tmp/etcd-job7",
        "--listen-client-urls", "http://10.77.0.2:2379", "--advertise-client-urls", "http://node1:2379",
        "--listen-peer-urls", "http://10.77.0.2:2380", "--initial-advertise-peer-urls", "http://node1:2380",
        "--initial-cluster", "node0=http://node0:2380,node1=http://node1:2380,node2=http://node2:2380",
        "--initial-cluster-token", "job7", "--initial-cluster-state", "new", "--election-timeout", "500"]
    assert config.endpoints == ["http://node0:2379", "http://node1:2379", "http://node2:2379"]


def test_defaults_come_from_the_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"node2": "10.77.0.3"}[name])
    monkeypatch.setattr(socket, "gethostname", lambda: "node2")
    config = EtcdMemberConfig(members="node0,node1,node2", token="job7")
    assert (config.name, config.address, config.data_dir) == ("node2", "10.77.0.3", str(tmp_path / "resihp-etcd-job7-node2"))


@pytest.mark.parametrize(("options", "option"), [
    ({"members": "node0,node0"}, "etcd_member.members"),
    ({"members": ""}, "etcd_member.members"),
    ({"members": "node0,node1", "name": "node7"}, "etcd_member.name"),
    ({"members": "node0,node1", "name": "node0", "address": "127.0.1.1"}, "etcd_member.address"),  # Debian's own name
    ({"members": "node0,node1", "name": "node0", "address": "node0"}, "etcd_member.address"),
    ({"members": "node0,node1", "name": "node0", "address": "10.0.0.1", "peer_port": 2379}, "etcd_member.peer_port"),
    ({"members": "node0,node1", "name": "node0", "address": "10.0.0.1", "client_port": 0}, "etcd_member.client_port"),
    ({"members": "node0,node1", "name": "node0", "address": "10.0.0.1", "token": ""}, "etcd_member.token"),
])
def test_bad_options_name_the_option(options, option):
    with pytest.raises(ConfigError, match=f"`{option}`"):
        EtcdMemberConfig(**options)


def test_the_command_line_prints_the_command_or_the_endpoints(capsys):
    assert main(["--members", "a,b,c", "--name", "b", "--address", "10.0.0.2", "--token", "t", "--data-dir", "/d",
                 "--print", "--", "--log-level", "warn"]) == 0
    assert capsys.readouterr().out.split() == EtcdMemberConfig(
        members="a,b,c", name="b", address="10.0.0.2", token="t", data_dir="/d", extra=("--log-level", "warn")).command()
    assert main(["--members", "a,b,c", "--client-port", "2479", "--endpoints"]) == 0
    assert capsys.readouterr().out == "http://a:2479,http://b:2479,http://c:2479\n"
    with pytest.raises(SystemExit):
        main(["--members", "a,b", "--name", "z", "--address", "10.0.0.2", "--print"])
    assert "etcd_member.name" in capsys.readouterr().err
