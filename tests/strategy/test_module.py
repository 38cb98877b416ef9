"""The LightningModule contract's defaults and checks (``resihp_lightning.strategy.module``)."""

from __future__ import annotations

import pytest
import torch


def test_the_default_pipeline_batch_takes_pairs_and_inputs_alone():
    """(inputs, labels) for training; for trainer.predict the inputs alone, as a tensor or as the
    one-element batch a DataLoader over TensorDataset(x) yields (it was refused); anything else is named."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning import ResiHPModule

    module = ResiHPModule()
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    inputs, labels, lens = module.pipeline_batch((x, y))
    assert inputs is x and labels is y and lens is None
    from_dataset = next(iter(DataLoader(TensorDataset(x), batch_size=6)))
    inputs, labels, _ = module.pipeline_batch(from_dataset)
    assert torch.equal(inputs, x) and labels is None
    assert module.pipeline_batch(x)[0] is x
    with pytest.raises(MisconfigurationException, match="expects batches of \\(inputs, labels\\)"):
        module.pipeline_batch((x, y, y))


def test_tied_parameter_names_are_checked():
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from resihp_lightning.strategy.module import tied_parameters

    def module(groups):
        return SimpleNamespace(pipeline_tied_parameters=lambda: groups)

    assert tied_parameters(module([("0.embed.weight", "9.head.weight")]), 10) == [((0, "embed.weight"), (9, "head.weight"))]
    assert tied_parameters(SimpleNamespace(), 10) == []
    for groups, message in (
        ([("0.embed.weight",)], "a tie needs at least two"),
        ([("0.embed.weight", "10.head.weight")], "layer index below 10"),
        ([("embed.weight", "9.head.weight")], "'<layer index>.<parameter name>'"),
        ([("0.", "9.head.weight")], "'<layer index>.<parameter name>'"),
    ):
        with pytest.raises(MisconfigurationException, match=message):
            tied_parameters(module(groups), 10)
