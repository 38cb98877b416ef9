"""Registration of "resihp" in Lightning's registry, whichever package is imported first.

Two fresh interpreters (the import order is the point), each with both ``lightning.pytorch`` and, when
installed, the standalone ``pytorch_lightning``: ``resihp_lightning`` imported first (it registers when
each package finishes importing) and the Lightning packages first (it registers at its own import). The
first also checks that ``import resihp_lightning`` alone imports neither torch nor Lightning, that
registering in ``pytorch_lightning`` imports no ``lightning.pytorch``, and the error a module without the
contract methods gets.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest


COMMON = """
import os, sys
from lightning.pytorch.strategies import StrategyRegistry
assert "resihp" in StrategyRegistry, sorted(StrategyRegistry)
trainer = pl.Trainer(strategy="resihp", accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
from resihp_lightning.strategy.strategy import ResiHPStrategy
assert type(trainer.strategy) is ResiHPStrategy, type(trainer.strategy)
"""


def _script(*parts: str) -> str:
    return "\n".join(textwrap.dedent(part) for part in parts)


class Interpreters:
    """Fresh interpreters for this module's selected tests, two running at a time.

    Each spends seconds importing Lightning on one core; two at a time use both cores of a small
    machine, one after another would leave one idle. The next one starts while a test checks the
    output of its own. Output goes to files: a pipe that nobody reads yet could fill up and stop it.
    """

    PARALLEL = 2

    def __init__(self, scripts: dict[str, str], folder: Path) -> None:
        self.pending = list(scripts.items())
        self.folder = folder
        self.running: dict[str, tuple[subprocess.Popen, Path]] = {}

    def _start_more(self, first: str | None = None) -> None:
        if first is not None and any(name == first for name, _ in self.pending):
            self.pending.sort(key=lambda item: item[0] != first)
        while self.pending and sum(p.poll() is None for p, _ in self.running.values()) < self.PARALLEL:
            name, code = self.pending.pop(0)
            out = self.folder / f"{len(self.running)}.out"
            # Port 0: the one process binds a free port itself (a port picked beforehand can be taken meanwhile).
            env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
                env.pop(key, None)
            with open(out, "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
                proc = subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=stderr, env=env)
            self.running[name] = (proc, out)

    def stdout(self, name: str) -> str:
        """Waits for ``name``'s interpreter (starting it first if it has not started); its stdout once it
        exited with 0."""
        while name not in self.running:
            self._start_more(first=name)
            if name not in self.running:
                next(p for p, _ in self.running.values() if p.poll() is None).wait(150)
        proc, out = self.running[name]
        try:
            proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        self._start_more()
        stdout = out.read_text()
        assert proc.returncode == 0, stdout[-3000:] + out.with_suffix(".err").read_text()[-3000:]
        return stdout

    def close(self) -> None:
        for proc, _ in self.running.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def interpreters(request, tmp_path_factory) -> Iterator[Interpreters]:
    selected = {item.name for item in request.session.items if item.module is request.module}
    pool = Interpreters({name: code for name, code in SCRIPTS.items() if name in selected},
                        tmp_path_factory.mktemp("registration"))
    pool._start_more()
    yield pool
    pool.close()


STANDALONE_REGISTRY = """
from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry
assert "resihp" in StandaloneRegistry, sorted(StandaloneRegistry)
"""

STANDALONE_TRAINER = """
standalone_trainer = ptl.Trainer(strategy="resihp", accelerator="cpu", devices=1, logger=False,
                                 enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
from resihp_lightning.strategy.standalone import ResiHPStrategy as StandaloneStrategy
assert type(standalone_trainer.strategy) is StandaloneStrategy, type(standalone_trainer.strategy)
assert isinstance(standalone_trainer.strategy, ptl.strategies.DDPStrategy)
"""

#: Whether the standalone ``pytorch_lightning`` package is installed (its checks run only then).
HAS_STANDALONE = importlib.util.find_spec("pytorch_lightning") is not None


def _standalone(*parts: str) -> str:
    """``parts`` as one script part where ``pytorch_lightning`` is installed, else nothing."""
    return _script(*parts) if HAS_STANDALONE else ""

CONTRACT_ERRORS = """
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
"""

# resihp_lightning first: registration waits for each package's import (the finder on sys.meta_path).
# The standalone package goes first, to check that registering in it imports no lightning.pytorch.
RESIHP_FIRST = _script(
    """
    import sys
    import resihp_lightning
    assert "torch" not in sys.modules and "lightning" not in sys.modules, "import must stay lazy"
    """,
    _standalone("import pytorch_lightning as ptl", STANDALONE_REGISTRY,
                'assert "lightning.pytorch" not in sys.modules, "registering in pytorch_lightning must not import lightning.pytorch"',
                STANDALONE_TRAINER),
    """
    import lightning.pytorch as pl
    """,
    COMMON,
    CONTRACT_ERRORS,
    'print("OK")',
)

# The Lightning packages first: resihp_lightning registers in both at its import.
LIGHTNING_FIRST = _script(
    """
    import lightning.pytorch as pl
    """,
    _standalone("import pytorch_lightning as ptl"),
    """
    import resihp_lightning
    """,
    COMMON,
    _standalone(STANDALONE_REGISTRY, STANDALONE_TRAINER),
    """
    assert resihp_lightning.ResiHPStrategy is ResiHPStrategy
    print("OK")
    """
)


#: Test name -> the script its fresh interpreter runs.
SCRIPTS = {
    "test_registered_when_resihp_is_imported_first_and_contract_errors_are_clear": RESIHP_FIRST,
    "test_registered_when_lightning_is_imported_first": LIGHTNING_FIRST,
}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_registered_when_resihp_is_imported_first_and_contract_errors_are_clear(interpreters, request):
    assert interpreters.stdout(request.node.name).strip().endswith("OK")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_registered_when_lightning_is_imported_first(interpreters, request):
    assert interpreters.stdout(request.node.name).strip().endswith("OK")
