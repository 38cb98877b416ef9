"""What a process that joins the running job takes from Lightning's side of the members.

A newcomer (``fail_stop`` join; :mod:`resihp_lightning.failstop.admission`) runs the user's unchanged
``Trainer(...).fit(model, data)`` from its admission on. Its layers and their optimizer state arrive
when a plan takes it in, as for any spare; what Lightning keeps outside the model comes from the
members' rank 0 at the start of the training step it is admitted at (:func:`capture`), and is put in
place before the newcomer's fit loop starts (:func:`apply`), the way Lightning resumes a checkpoint
taken mid-epoch:

* the fit loop's state (epoch, batch and optimizer-step progress: ``global_step``, ``batch_idx``,
  ``current_epoch``, when validation is due), restored as a restart: the newcomer's loop goes on from
  the step the members are at, skipping the sanity check and whatever the members ran before it;
* the LR schedulers' states and the optimizers' parameter-group settings (``lr`` ...; the parameters
  and their state come with the layers);
* the callbacks' states (``Callback.state_dict``);
* the data position: the newcomer's training loader leaves out the batches of the current epoch the
  members have trained on (:class:`SkipFirstBatches`; the sampler's epoch comes from the loop).

The loop's state is read inside the step, where Lightning has counted the step's batch as fetched but
not processed; restored, it resumes at that very batch (the restart rewinds the uncompleted counts).
Two things are adjusted: the loaders' own states are left out (a stateful loader has already yielded
the step's batch, and would resume after it; the newcomer skips to it instead), and the count of
batches that stepped is one lower (a restart adds one, for a checkpoint written at the end of a batch).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any


def capture(trainer: Any) -> dict[str, Any]:
    """At the start of the admission step, on every member (a callback's ``state_dict`` may be collective, as
    when Lightning writes a checkpoint): what a newcomer admitted there takes (rank 0's is sent)."""
    loop = copy.deepcopy(trainer.fit_loop.state_dict())
    loop.get("state_dict", {}).pop("combined_loader", None)
    epoch_loop = loop.get("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in epoch_loop:
        epoch_loop["_batches_that_stepped"] -= 1
    callbacks = {}
    for callback in trainer.callbacks:
        state = callback.state_dict()
        if state:
            callbacks[callback.state_key] = copy.deepcopy(state)
    return {
        "loop": loop,
        "schedulers": [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs],
        "param_groups": [[_settings(group) for group in optimizer.param_groups] for optimizer in trainer.optimizers],
        "callbacks": callbacks,
        "data": {"epoch": int(trainer.current_epoch),
                 "batches": int(trainer.fit_loop.epoch_loop.batch_progress.current.completed)},
        "global_step": int(trainer.global_step),
    }


def apply(trainer: Any, state: Mapping[str, Any]) -> None:
    """A newcomer, once its optimizer and schedulers exist and before its fit loop runs: takes the
    members' loop counters, schedulers and callbacks' states (see the module docstring)."""
    trainer.fit_loop.load_state_dict(copy.deepcopy(state["loop"]))
    schedulers = trainer.lr_scheduler_configs
    if len(schedulers) != len(state["schedulers"]):
        raise RuntimeError(
            f"this process configured {len(schedulers)} LR schedulers, the members {len(state['schedulers'])}: "
            "a newcomer must run the job's own script and configuration"
        )
    for config, saved in zip(schedulers, state["schedulers"]):
        config.scheduler.load_state_dict(copy.deepcopy(saved))
    for optimizer, groups in zip(trainer.optimizers, state["param_groups"]):
        apply_param_groups(optimizer.param_groups, groups)
    saved_callbacks = state["callbacks"]
    for callback in trainer.callbacks:
        if callback.state_key in saved_callbacks:
            callback.load_state_dict(copy.deepcopy(saved_callbacks[callback.state_key]))


def apply_param_groups(groups: Sequence[dict[str, Any]], saved: Sequence[Mapping[str, Any]]) -> None:
    """Sets the optimizer's parameter-group settings (``lr``, ``betas`` ...) to the members' (not the parameters)."""
    if len(groups) != len(saved):
        raise RuntimeError(f"this process's optimizer has {len(groups)} parameter groups, the members' {len(saved)}")
    for group, settings in zip(groups, saved):
        group.update(copy.deepcopy(dict(settings)))


def _settings(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}


class SkipFirstBatches:
    """A training loader whose first iterator leaves out its first ``count`` batches (read and dropped).

    Everything else is the wrapped loader's (length, sampler, dataset, its state for checkpoints), so that
    Lightning sets the sampler's epoch and saves the loader's state through it. The skip happens when the
    first batch is drawn, after Lightning has set the epoch (Lightning also calls ``iter`` on the loader
    only to check that it can: such an iterator is never drawn from and skips nothing). Loading the skipped
    batches is the cost; it is paid once, by the newcomer.

    Args:
        loader: the training loader.
        count: batches of the current epoch the members trained on.
    """

    def __init__(self, loader: Any, count: int) -> None:
        self.loader = loader
        self.count = count

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        return self._batches(iter(self.loader))

    def _batches(self, inner: Iterator[Any]) -> Iterator[Any]:
        skip, self.count = self.count, 0
        for index, batch in enumerate(inner):
            if index >= skip:
                yield batch
