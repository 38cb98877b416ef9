"""``FailStopConfig``'s join options: ``join`` / ``$RESIHP_JOIN`` and ``admission_timeout_s``."""

from __future__ import annotations

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.failstop.fail_stop_config import FailStopConfig


def test_join_comes_from_the_option_else_from_the_environment(monkeypatch):
    monkeypatch.delenv("RESIHP_JOIN", raising=False)
    assert not FailStopConfig().joins
    monkeypatch.setenv("RESIHP_JOIN", "1")
    assert FailStopConfig().joins and not FailStopConfig(join=False).joins
    monkeypatch.setenv("RESIHP_JOIN", "0")
    assert not FailStopConfig().joins and FailStopConfig(join=True).joins
    assert FailStopConfig.from_value({"join": True, "admission_timeout_s": 30}).admission_timeout_s == 30


@pytest.mark.parametrize(
    ("options", "env", "pattern"),
    [
        ({"join": "yes"}, None, "`fail_stop.join`"),
        ({"admission_timeout_s": 0}, None, "`fail_stop.admission_timeout_s`"),
        ({}, "true", "`RESIHP_JOIN`.*1 \\(join the running job\\), 0 or unset"),
    ],
)
def test_bad_join_options_are_named(monkeypatch, options, env, pattern):
    if env is None:
        monkeypatch.delenv("RESIHP_JOIN", raising=False)
    else:
        monkeypatch.setenv("RESIHP_JOIN", env)
    with pytest.raises(ConfigError, match=pattern):
        FailStopConfig(**options)


def test_joining_needs_fail_stop(monkeypatch):
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    monkeypatch.setenv("RESIHP_JOIN", "1")
    with pytest.raises(ConfigError, match="`?RESIHP_JOIN`?=1 \\(join a running job\\) needs ResiHPStrategy\\(fail_stop"):
        ResiHPStrategy()
    assert ResiHPStrategy(fail_stop=True)._joins
