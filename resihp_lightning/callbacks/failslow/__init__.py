"""Fail-slow detection: the workload model, the straggler core and its Lightning callback
(:class:`~.straggler_detector.StragglerDetector`), slow-link detection (:mod:`.link_core`)."""
