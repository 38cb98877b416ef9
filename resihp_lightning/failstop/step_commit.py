"""``StepCommit``: the vote that makes each optimizer step happen on every survivor or on none.

The layer-wise engine's optimizer step has a commit point (the loss average and the clipping norm
run first); the vote runs there, so a failure before it leaves no rank with an updated model, and
after it every survivor has stepped: the interrupted step is redone exactly.

The decision also tells every member, at no extra cost to the others, how many newcomers have
registered to join the job (:mod:`resihp_lightning.resilience.joining`): the member whose vote
completes the count reads that number (one store read per step, by one process) and writes it into
the decision, so that all members learn it at the same step and admit the newcomers together at the
next step boundary (:mod:`.admission`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

COMMIT, ABORT = "commit", "abort"


class StepCommit:
    """The commit vote of each optimizer step, over the rendezvous store (called by the engine).

    Every member adds its vote once its gradients are final; the member whose vote completes the count
    writes ``commit`` (with the number of newcomers ready to join, when ``newcomers`` is given), the
    first that sees the generation aborted first writes ``abort``, and every member follows whichever
    was written first. So either every survivor steps or none does.

    Args:
        world: the job's :class:`~resihp_lightning.resilience.world.ElasticWorld`.
        newcomers: reads how many newcomers have registered as ready (``None``: the job admits none).

    Attributes:
        newcomers_ready: the newcomer count of the last committed decision that carried one (every
            member reads the same decisions, so every member holds the same number).
    """

    def __init__(self, world: Any, newcomers: Callable[[], int] | None = None) -> None:
        self.world = world
        self.newcomers = newcomers
        self.newcomers_ready = 0
        self._count = 0
        self._generation = -1

    def __call__(self) -> None:
        world = self.world
        gen = world.current
        if gen.number != self._generation:
            self._generation, self._count = gen.number, 0
        self._count += 1
        store = world.store.control
        base = f"commit/gen{gen.number}/{self._count}"
        decision = f"{base}/decision"
        completes = int(store.add(f"{base}/votes", 1)) >= gen.world_size
        while True:
            if completes:
                # The last vote in: this member decides (no other member races it to a plain "commit").
                verdict = COMMIT if self.newcomers is None else f"{COMMIT} {int(self.newcomers())}"
            elif world.aborted:
                verdict = ABORT
            elif store.check([decision]):
                verdict = ""  # decided already: read it below
            else:
                time.sleep(0.0005)
                continue
            final = store.compare_set(decision, "", verdict) if verdict else store.get(decision)
            final = final.decode() if isinstance(final, bytes) else str(final)
            kind, _, newcomers = final.partition(" ")
            if kind == COMMIT:
                if newcomers:
                    self.newcomers_ready = max(self.newcomers_ready, int(newcomers))
                return
            world.abort(f"step {self._count} of generation {gen.number} was not committed", generation=gen)
            world.check()  # raises PeerFailure
