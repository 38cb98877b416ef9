"""Injected faults for experiments and tests: slowdowns of compute and links (:mod:`.slowdowns`) and the
Lightning callback that applies them (:class:`~.fault_injector.FaultInjector`)."""
