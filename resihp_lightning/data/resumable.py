"""A ``DataLoader`` that resumes mid-epoch where a checkpoint left off: no sample repeated or skipped.

Lightning saves the state of every training loader that has ``state_dict`` / ``load_state_dict``
(its ``_Stateful`` protocol) in the checkpoint's loop state, and hands it back before it iterates
the loader again on resume. :class:`ResumableDataLoader` is a plain ``torch.utils.data.DataLoader``
with that protocol. Its state is the sampler's epoch and the number of batches of that epoch the
training has consumed; on load it sets the sampler's epoch (so a shuffling sampler draws the same
permutation) and its first iterator skips the consumed batches by index, without loading them.

The count is exact under Lightning's training loop: its data fetcher reads a loader with a length
(a map-style dataset, which this loader requires) one batch at a time, without fetching ahead, so a
checkpoint written at the end of step k has seen exactly the k + 1 batches it trained on leave the
loader. Works with any sampler Lightning injects (``DistributedSampler`` with ``num_replicas=1`` under
``ResiHPStrategy``) and with worker processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader

from resihp_lightning.errors import ConfigError


class ResumableDataLoader(DataLoader):
    """``DataLoader`` whose position survives a checkpoint (Lightning's stateful-loader protocol).

    Args:
        *args: ``DataLoader``'s positional arguments (``dataset`` first).
        **kwargs: ``DataLoader``'s keyword arguments. A map-style dataset is required.

    Raises:
        ConfigError: the dataset is iterable-style (its position cannot be skipped to by index).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.dataset, Sized) or self._dataset_kind != 0:  # 0: map-style (torch's _DatasetKind.Map)
            raise ConfigError("ResumableDataLoader needs a map-style dataset (with __len__ and __getitem__)")
        self._skip = 0  # batches the next iterator leaves out (set by load_state_dict)
        self._epoch: int | None = None  # the sampler's epoch when the current iterator started
        self._yielded = 0  # batches of that epoch handed out, skipped ones included

    # --------------------------------------------------------------------- Lightning's protocol
    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": sampler epoch, "batches": batches of that epoch handed to the training}``."""
        return {"epoch": self._epoch, "batches": self._yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Makes the next iterator start after the saved position (same epoch, same order)."""
        epoch, batches = state_dict.get("epoch"), int(state_dict.get("batches", 0))
        if batches >= len(self):  # saved at the end of an epoch: the next one starts from its beginning
            epoch, batches = (None if epoch is None else epoch + 1), 0
        if epoch is not None:
            _set_epoch(self, epoch)
        self._skip = batches

    # ------------------------------------------------------------------------------ iteration
    @property
    def _index_sampler(self) -> Any:  # type: ignore[override]
        base = super()._index_sampler
        return _SkipFirst(base, self._skip) if self._skip else base

    def __iter__(self) -> Iterator[Any]:
        self._epoch = _epoch_of(self)
        skip = self._skip
        inner = super().__iter__()  # reads _index_sampler once: the skip applies to this iterator only
        self._skip = 0
        self._yielded = skip
        return self._counting(inner)

    def _counting(self, inner: Iterator[Any]) -> Iterator[Any]:
        for batch in inner:
            self._yielded += 1
            yield batch


class _SkipFirst:
    """A batch sampler without its first ``count`` batches; its length stays the full epoch's, as
    Lightning counts the resumed epoch's batches from the saved position."""

    def __init__(self, base: Any, count: int) -> None:
        self.base, self.count = base, count

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.base)
        for _ in range(self.count):
            next(it, None)
        yield from it

    def __len__(self) -> int:
        return len(self.base)


def _samplers(loader: DataLoader) -> list[Any]:
    found = [loader.sampler]
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and getattr(batch_sampler, "sampler", None) is not None:
        found.append(batch_sampler.sampler)
    return found


def _epoch_of(loader: DataLoader) -> int | None:
    for sampler in _samplers(loader):
        epoch = getattr(sampler, "epoch", None)
        if isinstance(epoch, int):
            return epoch
    return None


def _set_epoch(loader: DataLoader, epoch: int) -> None:
    for sampler in _samplers(loader):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
