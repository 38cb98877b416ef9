"""Each callback checks at ``setup`` what it needs from the strategy (``resihp_lightning.contract``).

A job with a strategy that lacks the contract fails at once with a ``ConfigError`` that names the
missing members, instead of training on without detection or re-planning. Real Lightning Trainers
with Lightning's own strategies (``ddp`` on one CPU device, or the default single-device one).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
from resihp_lightning.callbacks.progress import ResiHPProgressBar, StepRecorder
from resihp_lightning.errors import ConfigError

REPLANNABLE = ("last_step_stats", "collectives_interrupted", "collective", "local_layers", "current_plan",
               "micro_batches", "supports_per_replica_bounds", "last_migration", "devices_alive", "supports_idle_devices",
               "profiler_recording", "request_plan", "layer_profile")


def _trainer(tmp_path, callbacks, strategy="auto") -> pl.Trainer:
    bar = any(isinstance(cb, pl.callbacks.ProgressBar) for cb in callbacks)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, callbacks=callbacks, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=bar, enable_model_summary=False,
                      default_root_dir=str(tmp_path))


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)


def _missing(message: str) -> set[str]:
    named = message.split(" needs a strategy with ", 1)[1].split(" (", 1)[0]
    return set(named.split(", "))


def test_replan_controller_refuses_a_strategy_without_the_replanning_api(tmp_path):
    controller = ReplanController()
    trainer = _trainer(tmp_path, [StragglerDetector(log_dir=str(tmp_path)), controller], strategy="ddp")
    with pytest.raises(ConfigError, match=r"ReplanController needs a strategy with .*\(Replannable in "
                                          r"resihp_lightning.contract\); DDPStrategy lacks them") as err:
        controller.setup(trainer, None, "fit")
    assert _missing(str(err.value)) == set(REPLANNABLE)
    assert "strategy='resihp'" in str(err.value)


def test_fit_with_a_plain_strategy_fails_at_setup_before_any_step(tmp_path):
    steps = []

    class Count(pl.Callback):
        def on_train_batch_end(self, *args):
            steps.append(1)

    with pytest.raises(ConfigError, match="ReplanController needs a strategy with .*SingleDeviceStrategy lacks them"):
        _trainer(tmp_path, [ReplanController(log_dir=str(tmp_path)), Count()]).fit(_Linear())
    with pytest.raises(ConfigError, match=r"StragglerDetector needs a strategy with last_step_stats, collectives_interrupted, collective \(StepStatsSource"):
        _trainer(tmp_path, [StragglerDetector(log_dir=str(tmp_path)), Count()]).fit(_Linear())
    assert steps == []


def test_fault_injector_needs_layers_only_for_a_fault_on_its_own_rank(tmp_path):
    # slow, kill and hang act on this rank's layers (kill / hang strike inside the step's schedule).
    for fault in ({"kind": "slow", "rank": 0, "factor": 2.0}, {"kind": "kill", "rank": 0, "start_step": 99}):
        here = FaultInjector(fault, log_dir=str(tmp_path))
        with pytest.raises(ConfigError, match=r"FaultInjector \(a slow, kill or hang fault on this rank\) needs a "
                                              r"strategy with local_layers \(LayerHost"):
            here.setup(_trainer(tmp_path, [here], strategy="ddp"), None, "fit")
    for faults in ({"kind": "slow", "rank": 3, "factor": 2.0}, {"kind": "delay_p2p", "rank": 0, "delay_ms": 1.0}):
        injector = FaultInjector(faults, log_dir=str(tmp_path))
        injector.setup(_trainer(tmp_path, [injector], strategy="ddp"), None, "fit")
        injector.teardown(None, None, "fit")


def test_step_recorder_and_progress_bar_check_what_they_read(tmp_path):
    recorder = StepRecorder()
    with pytest.raises(ConfigError, match="StepRecorder needs a strategy with .*current_plan"):
        recorder.setup(_trainer(tmp_path, [recorder]), None, "fit")
    bar = ResiHPProgressBar(StepRecorder())
    with pytest.raises(ConfigError, match=r"needs that StepRecorder in Trainer\(callbacks=\[...\]\)"):
        bar.setup(_trainer(tmp_path, [bar]), None, "fit")
    recorder = StepRecorder()
    bar = ResiHPProgressBar(recorder)
    with pytest.raises(ConfigError, match="put the StepRecorder before the ResiHPProgressBar"):
        bar.setup(_trainer(tmp_path, [bar, recorder]), None, "fit")
