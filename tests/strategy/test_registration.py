"""Registration of "resihp" in Lightning's registry, whichever package is imported first.

Each check runs in a fresh interpreter (the import order is the point); both also check that
``import resihp_lightning`` alone imports neither torch nor Lightning, and one checks the error a
module without the contract methods gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from resihp_lightning.testing.multiproc import free_port

COMMON = """
import os, sys
from lightning.pytorch.strategies import StrategyRegistry
assert "resihp" in StrategyRegistry, sorted(StrategyRegistry)
trainer = pl.Trainer(strategy="resihp", accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
from resihp_lightning.strategy.strategy import ResiHPStrategy
assert type(trainer.strategy) is ResiHPStrategy, type(trainer.strategy)
"""


def _run(*parts: str) -> str:
    code = "\n".join(textwrap.dedent(part) for part in parts)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=150, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_registered_when_resihp_is_imported_first_and_contract_errors_are_clear():
    out = _run(
        """
        import sys
        import resihp_lightning
        assert "torch" not in sys.modules and "lightning" not in sys.modules, "import must stay lazy"
        import lightning.pytorch as pl
        """,
        COMMON,
        """
        import torch
        from lightning.pytorch.utilities.exceptions import MisconfigurationException
        from torch.utils.data import DataLoader, TensorDataset

        class OnlyLayers(resihp_lightning.ResiHPModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(2, 2)
            def pipeline_layers(self):
                return [self.layer]
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        class Plain(pl.LightningModule):
            def training_step(self, batch, batch_idx):
                return None
            def configure_optimizers(self):
                return None

        data = DataLoader(TensorDataset(torch.zeros(4, 2), torch.zeros(4, 2)), batch_size=2)
        for module, expected in ((OnlyLayers(), "does not implement pipeline_loss()"),
                                 (Plain(), "does not implement pipeline_layers(), pipeline_loss()")):
            trainer = pl.Trainer(strategy="resihp", accelerator="cpu", devices=1, logger=False, max_steps=1,
                                 enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
            try:
                trainer.fit(module, data)
            except MisconfigurationException as err:
                assert expected in str(err), str(err)
                assert "resihp_lightning.ResiHPModule" in str(err), str(err)
            else:
                raise AssertionError("no error for " + type(module).__name__)
        print("OK")
        """
    )
    assert out.strip().endswith("OK")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_registered_when_lightning_is_imported_first():
    out = _run(
        """
        import lightning.pytorch as pl
        import resihp_lightning
        """,
        COMMON,
        """
        assert resihp_lightning.ResiHPStrategy is ResiHPStrategy
        print("OK")
        """
    )
    assert out.strip().endswith("OK")


STANDALONE = """
from pytorch_lightning.strategies import StrategyRegistry
assert "resihp" in StrategyRegistry, sorted(StrategyRegistry)
assert "lightning.pytorch" not in sys.modules, "registering in pytorch_lightning must not import lightning.pytorch"
trainer = pl.Trainer(strategy="resihp", accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
from resihp_lightning.strategy.standalone import ResiHPStrategy
assert type(trainer.strategy) is ResiHPStrategy, type(trainer.strategy)
assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)
print("OK")
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("first", ["resihp_lightning", "pytorch_lightning"])
def test_registered_in_standalone_pytorch_lightning(first):
    pytest.importorskip("pytorch_lightning")
    second = "pytorch_lightning" if first == "resihp_lightning" else "resihp_lightning"
    out = _run(f"import sys\nimport {first}\nimport {second}\nimport pytorch_lightning as pl\n", STANDALONE)
    assert out.strip().endswith("OK")
