"""``StepCommit``: the vote that makes each optimizer step happen on every survivor or on none.

The layer-wise engine's optimizer step has a commit point (the loss average and the clipping norm
run first); the vote runs there, so a failure before it leaves no rank with an updated model, and
after it every survivor has stepped: the interrupted step is redone exactly.
"""

from __future__ import annotations

import time
from typing import Any


class StepCommit:
    """The commit vote of each optimizer step, over the rendezvous store (called by the engine).

    Every member adds its vote once its gradients are final; the first member that sees all votes
    writes ``commit``, the first that sees the generation aborted first writes ``abort``, and every
    member follows whichever was written first. So either every survivor steps or none does.
    """

    def __init__(self, world: Any) -> None:
        self.world = world
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
        votes = int(store.add(f"{base}/votes", 1))
        while True:
            if votes >= gen.world_size:
                verdict = "commit"
            elif world.aborted:
                verdict = "abort"
            else:
                time.sleep(0.0005)
                votes = int(store.add(f"{base}/votes", 0))
                continue
            final = store.compare_set(f"{base}/decision", "", verdict)
            final = final.decode() if isinstance(final, bytes) else str(final)
            if final == "commit":
                return
            world.abort(f"step {self._count} of generation {gen.number} was not committed", generation=gen)
            world.check()  # raises PeerFailure
