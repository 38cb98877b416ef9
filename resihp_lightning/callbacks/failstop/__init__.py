"""Fail-stop reporting: the heartbeat monitor callback and :class:`~.failstop_reporter.FailStopReporter`
(recoveries into the event log)."""
