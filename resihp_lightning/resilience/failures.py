"""Exceptions of the in-process recovery mechanism.

The training loop catches :class:`PeerFailure` around its steps (see
:meth:`~resihp_lightning.resilience.world.ElasticWorld.guard`) and answers it with a regroup; the
others mean that this process cannot take part in the next generation and should end.
"""

from __future__ import annotations

from collections.abc import Mapping

from resihp_lightning.errors import ResiHPError


class ResilienceError(ResiHPError):
    """Base class of the recovery mechanism's errors."""


class PeerFailure(ResilienceError):
    """The current generation was aborted because peers failed (or a collective broke).

    Attributes:
        generation: the generation that was aborted.
        failed: original rank -> reason, for the failures known when this was raised. It may be
            empty when this process's own collective broke before any detector had named the dead
            peer; :meth:`ElasticWorld.regroup <.world.ElasticWorld.regroup>` settles who is gone.
        reason: what triggered the abort.
    """

    def __init__(self, generation: int, failed: Mapping[int, str], reason: str) -> None:
        self.generation = generation
        self.failed = dict(failed)
        self.reason = reason
        named = ", ".join(f"{rank} ({why})" for rank, why in sorted(self.failed.items())) or "not yet known"
        super().__init__(f"generation {generation} aborted: {reason}; failed ranks: {named}")


class PeerFinished(ResilienceError):
    """A collective needed a peer that has finished: it ended on purpose (fit returned, it said goodbye and exited).

    Not a failure: nobody regroups, and the peers' collectives that do not need it go on. Raised by
    :meth:`ElasticWorld.guard <.world.ElasticWorld.guard>` when a collective broke and the only members
    gone are finished ones: the program asked a process that had ended for its part.

    Attributes:
        generation: the generation the collective ran in.
        finished: the original ranks of its members that have finished.
    """

    def __init__(self, generation: int, finished: frozenset[int] | set[int], detail: str) -> None:
        self.generation = generation
        self.finished = frozenset(finished)
        super().__init__(
            f"a collective of generation {generation} needs rank(s) {sorted(self.finished)}, which finished "
            f"(returned from the trainer and exited): a collective after fit must run only among the processes "
            f"still running it ({detail})"
        )


class EvictedError(ResilienceError):
    """This process is not a member of the new generation (its peers declared it failed)."""

    def __init__(self, rank: int, generation: int, members: list[int]) -> None:
        self.rank = rank
        self.generation = generation
        self.members = list(members)
        super().__init__(f"rank {rank} was left out of generation {generation} (members: {self.members})")


class RegroupError(ResilienceError):
    """The survivors could not form a new generation in time, or too few of them are left."""


class StoreUnavailable(ResilienceError):
    """The rendezvous store cannot be reached (its host process is gone or never came up)."""


class AdmissionError(ResilienceError):
    """A process that asked to join a running job (``fail_stop`` join) was not admitted: no running job
    in the store it was pointed at, or none admitted it in time."""
