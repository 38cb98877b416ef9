"""Delays on the runtime's transports, for injected link faults: DeepSpeed's pipeline sends, the gradient
all-reduces and the link probe's sends.

:class:`DelayedCall` patches one function in a module namespace to wait before each call;
:func:`delay_p2p_sends` uses it on DeepSpeed's pipeline ``p2p.send`` and :func:`slow_links` on every
transfer of one rank (a slow network link). The fault injector
(:mod:`resihp_lightning.callbacks.faults.fault_injector`) applies them; this module is where the
knowledge of which functions the runtime sends through lives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class DelayedCall:
    """Replaces ``namespace.name`` with a version that first sleeps ``delay_s_fn()`` seconds.

    Args:
        namespace: a module (or any object) holding the function.
        name: the attribute to patch.
        delay_s_fn: returns the wait in seconds (0 = no wait) at each call.
    """

    def __init__(self, namespace: Any, name: str, delay_s_fn: Callable[[], float]) -> None:
        self.namespace, self.name = namespace, name
        self.original = getattr(namespace, name)
        self.calls = 0
        self.delayed_s = 0.0
        original = self.original

        def delayed(*args: Any, **kwargs: Any) -> Any:
            wait = float(delay_s_fn())
            if wait > 0:
                time.sleep(wait)
                self.delayed_s += wait
            self.calls += 1
            return original(*args, **kwargs)

        setattr(namespace, name, delayed)

    def restore(self) -> None:
        setattr(self.namespace, self.name, self.original)


def delay_p2p_sends(delay_s_fn: Callable[[], float]) -> DelayedCall:
    """Delays DeepSpeed pipeline sends (``deepspeed.runtime.pipe.p2p.send``, looked up per call by the engine)."""
    from deepspeed.runtime.pipe import p2p

    return DelayedCall(p2p, "send", delay_s_fn)


def slow_links(delay_s_fn: Callable[[], float]) -> list[DelayedCall]:
    """Delays this rank's pipeline sends, its gradient all-reduces (``torch.distributed.all_reduce``,
    which the layer-wise reducer looks up per call) and the link probe's sends: a slow network link on
    the rank, seen by every peer that exchanges with it. Compute is untouched."""
    import torch.distributed as dist

    from resihp_lightning.runtime import link_probe

    return [delay_p2p_sends(delay_s_fn), DelayedCall(dist, "all_reduce", delay_s_fn),
            DelayedCall(link_probe, "send", delay_s_fn)]
