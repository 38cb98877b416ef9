"""``resilience.failures``: the errors the recovery raises."""

from __future__ import annotations

from resihp_lightning.resilience.failures import PeerFailure


def test_peer_failure_names_the_ranks():
    failure = PeerFailure(3, {2: "exited", 0: "silent"}, "rank 2 exited")
    assert failure.failed == {0: "silent", 2: "exited"}
    assert "0 (silent), 2 (exited)" in str(failure)
    assert "not yet known" in str(PeerFailure(0, {}, "collective failed"))
