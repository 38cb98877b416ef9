"""Ranks for one launcher per process (``resihp_lightning.process_ranks``): the variables, the order.

The store exchange itself runs across namespace machines in
tests/machines/test_torchrun_machines.py (one ``torchrun --standalone`` agent per process).
"""

from __future__ import annotations

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.process_ranks import ASSIGNED, RankRequest, assign, ensure_process_ranks

GOOD = {"RESIHP_RANKS_AT": "node0:29500", "RESIHP_WORLD_SIZE": "6", "RESIHP_NPROC_PER_NODE": "2",
        "RESIHP_LOCAL_INDEX": "1", "RESIHP_NODE_NAME": "node2"}


def test_the_request_is_read_from_the_variables_with_defaults() -> None:
    request = RankRequest.from_env(GOOD)
    assert request == RankRequest(endpoint=("node0", 29500), world_size=6, local_index=1, nproc_per_node=2,
                                  job_id="resihp", node_name="node2", timeout_s=300.0, master_addr="node0")
    assert RankRequest.from_env({"RESIHP_WORLD_SIZE": "6"}) is None  # not asked for: nothing to do
    ipv6 = RankRequest.from_env({**GOOD, "RESIHP_RANKS_AT": "[fe80::1]:29500", "RESIHP_JOB_ID": "run-7"})
    assert ipv6.endpoint == ("fe80::1", 29500) and ipv6.job_id == "run-7"


@pytest.mark.parametrize(("name", "value", "says"), [
    ("RESIHP_RANKS_AT", "node0", "host:port"),
    ("RESIHP_RANKS_AT", "node0:70000", "1..65535"),
    ("RESIHP_WORLD_SIZE", "0", "RESIHP_WORLD_SIZE must be an integer >= 1"),
    ("RESIHP_WORLD_SIZE", None, "RESIHP_WORLD_SIZE must be an integer >= 1"),
    ("RESIHP_NPROC_PER_NODE", "two", "RESIHP_NPROC_PER_NODE must be an integer >= 1"),
    ("RESIHP_LOCAL_INDEX", "2", "must be below RESIHP_NPROC_PER_NODE=2"),
    ("RESIHP_LOCAL_INDEX", "-1", "RESIHP_LOCAL_INDEX must be an integer >= 0"),
    ("RESIHP_RANKS_TIMEOUT_S", "0", "RESIHP_RANKS_TIMEOUT_S"),
])
def test_a_bad_variable_is_named_with_what_is_allowed(name: str, value: str | None, says: str) -> None:
    env = {k: v for k, v in GOOD.items() if k != name}
    if value is not None:
        env[name] = value
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(".", r"\.")):
        RankRequest.from_env(env)


def test_ranks_follow_node_names_then_local_indexes_whatever_the_registration_order() -> None:
    members = [("node2", 1), ("node0", 1), ("node1", 0), ("node2", 0), ("node0", 0), ("node1", 1)]
    ranks = {m: assign(members, m, 6) for m in members}
    assert {m: (a.rank, a.node_rank) for m, a in ranks.items()} == {
        ("node0", 0): (0, 0), ("node0", 1): (1, 0), ("node1", 0): (2, 1), ("node1", 1): (3, 1),
        ("node2", 0): (4, 2), ("node2", 1): (5, 2)}
    assert {a.first_node for a in ranks.values()} == {"node0"}  # MASTER_ADDR: where rank 0 runs


def test_two_processes_in_one_place_or_a_wrong_count_are_refused() -> None:
    with pytest.raises(ConfigError, match="two processes registered as node1:0"):
        assign([("node0", 0), ("node1", 0), ("node1", 0)], ("node0", 0), 3)
    with pytest.raises(ConfigError, match="2 processes registered, RESIHP_WORLD_SIZE is 3"):
        assign([("node0", 0), ("node1", 0)], ("node0", 0), 3)


def test_one_process_job_takes_its_ranks_from_a_store_it_serves_itself() -> None:
    """The whole exchange on one machine, world size 1 (this process hosts the store and is rank 0)."""
    from resihp_lightning.testing.multiproc import free_port

    env = {"RESIHP_RANKS_AT": f"127.0.0.1:{free_port()}", "RESIHP_WORLD_SIZE": "1", "RESIHP_NPROC_PER_NODE": "1",
           "RESIHP_LOCAL_INDEX": "0", "RESIHP_JOB_ID": "solo", "RANK": "0", "WORLD_SIZE": "1"}
    place = ensure_process_ranks(env)
    assert place is not None and (place.rank, place.node_rank) == (0, 0)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", ASSIGNED)} == {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "solo", "TORCHELASTIC_USE_AGENT_STORE": "False", ASSIGNED: "1"}
    assert env["MASTER_PORT"].isdigit() and env["MASTER_ADDR"]
    assert ensure_process_ranks(env) is None  # once per process


def test_a_newcomer_registers_nowhere_and_is_pointed_at_the_running_job() -> None:
    """``RESIHP_JOIN=1``: no rank store is contacted (its host ended long ago); the variables lead the
    strategy to the job's fail-stop store, and its rank is none of the job's (the store's join counter gives it)."""
    env = {**GOOD, "RESIHP_JOIN": "1", "RESIHP_JOB_ID": "job7", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}
    assert RankRequest.from_env(env).join
    assert ensure_process_ranks(env) is None
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", ASSIGNED)} == {
        "RANK": "6", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "3",
        "MASTER_ADDR": "node0", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_USE_AGENT_STORE": "False", ASSIGNED: "join"}
    assert ensure_process_ranks(env, join=True) is None  # once per process
    with pytest.raises(ConfigError, match="already took its ranks as a newcomer"):
        ensure_process_ranks(env, join=False)
    elsewhere = {**GOOD, "RESIHP_JOIN": "1", "RESIHP_MASTER_ADDR": "10.0.0.1"}
    ensure_process_ranks(elsewhere)
    assert elsewhere["MASTER_ADDR"] == "10.0.0.1"
    by_config = dict(GOOD)  # fail_stop.join=True without the variable: the same
    ensure_process_ranks(by_config, join=True)
    assert by_config[ASSIGNED] == "join" and by_config["RANK"] == "6"


@pytest.mark.parametrize(("extra", "says"), [
    ({"RESIHP_JOIN": "yes"}, "RESIHP_JOIN='yes': allowed are 1"),
    ({"RESIHP_MASTER_ADDR": "node0"}, "RESIHP_MASTER_ADDR='node0' is for a process that joins"),
    ({"RESIHP_JOIN": "1", "RESIHP_LOCAL_INDEX": "2"}, "must be below RESIHP_NPROC_PER_NODE=2"),
])
def test_a_bad_join_combination_is_refused_by_name(extra: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(".", r"\.")):
        RankRequest.from_env({**GOOD, **extra})


def test_a_process_that_registered_cannot_join_afterwards() -> None:
    env = {**GOOD, ASSIGNED: "1"}
    with pytest.raises(ConfigError, match="as one of the job's processes from the rank store: .* set RESIHP_JOIN=1"):
        ensure_process_ranks(env, join=True)
    assert ensure_process_ranks(env, join=False) is None and ensure_process_ranks(env) is None
