"""``ResiHPStrategy(tensor_degree=2)``: a tensor x pipeline x data-parallel job on 4 gloo processes.

Each run trains a Llama / tied-embedding Qwen2 ``CausalLMPipelineModule`` (from scratch, or read per stage
from an HF checkpoint) for a few steps with its layers split over groups of two processes, re-planning
once (layers move between the groups), and must match one process training the unsplit model (a plain
loop here, with the module's own optimizer): the same loss at every step and the same trained weights,
which come back whole into the LightningModule, a Lightning checkpoint (resumable) and an HF save.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from resihp_lightning.config import ScratchModelConfig
from resihp_lightning.testing.tensor_jobs import document_batches

STEPS = 3
LR = 1e-2
#: Split matmuls sum in another order, and Adam divides each gradient by its own running scale, so an
#: element with a near-zero gradient moves by round-off times the learning rate: weights agree to 1% of
#: one step's update (a wrong shard or a missing sum is off by whole updates, 1e-2).
WEIGHT_ATOL = 1e-4


@dataclass(frozen=True)
class Run:
    """One training run of the job.

    Attributes:
        model_type: ``"llama"`` or ``"qwen2"``.
        tie: tied input and output embeddings.
        pipeline_degree: of the starting plan over the 2 groups.
        clip: ``Trainer(gradient_clip_val)``.
        replan: the plan requested after the first step.
        hf_dir: read the model per stage from this HF checkpoint (``None``: a scratch model).
    """

    model_type: str
    tie: bool
    pipeline_degree: int
    clip: float | None
    replan: dict
    hf_dir: str | None = None

    @property
    def name(self) -> str:
        return f"{self.model_type}-{self.pipeline_degree}" + ("-hf" if self.hf_dir else "")


def _module(run: Run, load: str = "per_stage"):
    from resihp_lightning.models import CausalLMPipelineModule

    if run.hf_dir is not None:
        return CausalLMPipelineModule(model_path=run.hf_dir, load=load, learning_rate=LR, weight_decay=0.1)
    # Its own ``seed`` initialises a scratch model (no global seeding here: PL_GLOBAL_SEED in the test
    # process's environment would reach the processes other tests spawn).
    shape = ScratchModelConfig(model_type=run.model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=run.tie)
    return CausalLMPipelineModule(scratch=shape, seed=7, learning_rate=LR, weight_decay=0.1)


def _reference(run: Run, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the unsplit model, the module's own optimizer: what the split job must reproduce."""
    module = _module(run, load="whole")
    layers = module.pipeline_layers()
    if run.tie:  # the module keeps a copy per layer (the strategy keeps them equal); here: one parameter
        layers[-1].lm_head.weight = layers[0].embed_tokens.weight
    optimizer = module.configure_optimizers()
    losses = []
    for batch in document_batches(steps):
        rows = batch["input_ids"].shape[0]
        loss = torch.zeros(())
        for row in range(rows):  # a micro-batch per row, as the job runs them: the mean of their losses
            inputs, labels, _ = module.pipeline_batch({k: v[row:row + 1] for k, v in batch.items()})
            outputs = inputs
            for layer in layers:
                outputs = layer(outputs)
            loss = loss + module.pipeline_loss(outputs, labels) / rows
        optimizer.zero_grad()
        loss.backward()
        if run.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), run.clip)
            assert norm > run.clip  # the clipping changes the step
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _job(rank: int, world: int, runs: list[Run], ckpt_dir: str) -> dict:
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.strategy.strategy import ResiHPStrategy

    warnings.filterwarnings("ignore")

    class Losses(pl.Callback):
        """Records the losses; after the first step asks for ``replan`` (layers move between groups)."""

        def __init__(self, replan: dict | None) -> None:
            self.values: list[float] = []
            self.replan = replan

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append(float(outputs["loss"]))
            if self.replan is not None and trainer.global_step == 1:
                trainer.strategy.request_plan(Plan.from_dict(self.replan))

    from resihp_lightning.callbacks.progress import StepRecorder
    from resihp_lightning.plan import Plan

    def fit(run, batches, steps, ckpt_path=None):
        module = _module(run)
        losses = Losses(run.replan if ckpt_path is None else None)
        recorder = StepRecorder(f"{ckpt_dir}/{run.name}" if ckpt_path is None else None)
        # gather_weights="all": a module read per stage would keep only its own layers (its default).
        strategy = ResiHPStrategy(tensor_degree=2, pipeline_degree=run.pipeline_degree, micro_batch_size=1,
                                  micro_batches=4, gather_weights="all")
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            use_distributed_sampler=False, callbacks=[losses, recorder], default_root_dir=ckpt_dir,
            gradient_clip_val=run.clip,
        )
        trainer.fit(module, DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
        return module, losses, strategy, trainer

    results = {}
    for run in runs:
        module, losses, strategy, trainer = fit(run, document_batches(STEPS), STEPS)
        name = run.name
        path = f"{ckpt_dir}/{name}.ckpt"
        trainer.save_checkpoint(path)
        module.save_hf_checkpoint(f"{ckpt_dir}/hf-{name}")  # every rank; a stage's member 0 writes its layers
        probe = document_batches(STEPS + 2)[-1]
        predicted = trainer.predict(module, DataLoader([probe], batch_size=None))[0]
        validated = trainer.validate(module, DataLoader([probe], batch_size=None), verbose=False)[0]["val_loss"]
        # Resumed from the checkpoint (weights and Adam state split again), one more step on the next batch.
        resumed, more, _, _ = fit(run, document_batches(STEPS + 1)[STEPS:], STEPS + 1, ckpt_path=path)
        local = {i: sorted(n for n, _ in layer.named_parameters()) for i, layer in strategy.local_layers().items()}
        results[name] = {
            "losses": losses.values,
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "plan": strategy.current_plan.to_dict(),
            "moved": strategy.last_migration.bytes_moved if strategy.last_migration is not None else 0,
            "device_id": strategy.device_id,
            "local_shapes": {i: [tuple(p.shape) for p in layer.parameters()] for i, layer in strategy.local_layers().items()},
            "local": local,
            "checkpoint": path,
            "recorded": len((Path(ckpt_dir) / name / "steps.jsonl").read_text().splitlines()) if rank == 0 else None,
            "predicted": predicted,
            "validated": float(validated),
            "resumed_losses": more.values,
            "resumed_state": {k: v.detach().clone() for k, v in resumed.state_dict().items()},
        }
    return results


# The 2 groups as P=2 x D=1, then as P=1 x D=2 with global-norm clipping (the norm adds the shards over a
# group). After the first step a re-plan moves layers between the groups: shard i goes from member i to
# member i. The last run reads its layers per stage from an HF checkpoint (the first run's model, saved).
SWAP = {"replicas": [{"devices": [1, 0], "bounds": [0, 3, 4], "micro_batches": 4}]}
RUNS = [
    Run("llama", False, 2, None, SWAP),
    Run("qwen2", True, 1, 0.5, {"replicas": [{"devices": [0, 1], "bounds": [0, 2, 4], "micro_batches": 4}]}),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_tensor_parallel_job_trains_exactly_like_one_process(distributed, tmp_path):
    from transformers import AutoModelForCausalLM

    from resihp_lightning.models import CausalLMPipelineModule

    hf_dir = tmp_path / "llama-hf-start"
    _module(RUNS[0]).save_hf_checkpoint(hf_dir)  # outside the strategy: the module's own weights
    runs = [*RUNS, Run("llama", False, 2, None, SWAP, hf_dir=str(hf_dir))]
    results = distributed(_job, 4, timeout=280, runs=runs, ckpt_dir=str(tmp_path))
    for run in runs:
        name, pipeline_degree = run.name, run.pipeline_degree
        ref_losses, ref_state = _reference(run)
        for rank, result in enumerate(results):
            got = result[name]
            # Plans name the two groups: ranks 0, 1 are group 0 and ranks 2, 3 group 1.
            assert got["device_id"] == rank // 2
            assert got["recorded"] == (STEPS if rank == 0 else None)  # StepRecorder works (rank 0 writes steps.jsonl)
            assert got["plan"]["replicas"] == run.replan["replicas"]  # the re-plan took effect
            # From 2 x 1 every process receives layers; from 1 x 2 (each group held all) they only give some up.
            assert (got["moved"] > 0) == (pipeline_degree == 2)
            # Each member holds half of every split matrix: e.g. the embedding's vocabulary rows.
            if 0 in got["local_shapes"]:
                assert got["local_shapes"][0][0] == (130, 32), got["local_shapes"][0]
            assert got["losses"] == pytest.approx(ref_losses, abs=2e-5, rel=0), (name, rank)
            # The trained weights come back whole into every rank's module (gather_weights="all").
            assert got["state"].keys() == ref_state.keys()
            for key, want in ref_state.items():
                torch.testing.assert_close(got["state"][key], want, atol=WEIGHT_ATOL, rtol=0,
                                           msg=f"{name} rank {rank} {key}")
        # trainer.predict returns the whole logits (the members' vocabulary shards joined), validate the loss.
        reference = _module(run, load="whole")
        reference.load_state_dict(ref_state)
        probe = document_batches(STEPS + 2)[-1]
        with torch.no_grad():
            outputs = reference.pipeline_batch(probe)[0]
            for layer in reference.pipeline_layers():
                outputs = layer(outputs)
            labels = probe["labels"]
            ref_val = sum(float(reference.pipeline_loss(outputs[r:r + 1], labels[r:r + 1])) for r in range(len(labels))) / len(labels)
        for rank, result in enumerate(results):
            got = result[name]
            assert got["predicted"].shape == outputs.shape == (4, 24, 260)
            torch.testing.assert_close(got["predicted"], outputs, atol=1e-4, rtol=0, msg=f"{name} predict rank {rank}")
            assert got["validated"] == pytest.approx(ref_val, abs=1e-4)
        # The HF save from the stages holds the whole trained matrices.
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{name}", local_files_only=True).state_dict()
        last = len(reference.pipeline_layers()) - 1
        for hf_key, key in (("model.embed_tokens.weight", "layers.0.embed_tokens.weight"),
                            ("lm_head.weight", f"layers.{last}.lm_head.weight"),
                            ("model.layers.1.mlp.down_proj.weight", "layers.2.layer.mlp.down_proj.weight"),
                            ("model.layers.0.self_attn.q_proj.weight", "layers.1.layer.self_attn.q_proj.weight")):
            torch.testing.assert_close(saved[hf_key], ref_state[key], atol=WEIGHT_ATOL, rtol=0, msg=f"{name} HF {hf_key}")
        # Resumed: the next step is the reference's next step (the optimizer state came back too).
        ref_more, ref_after = _reference(run, STEPS + 1)
        for rank, result in enumerate(results):
            got = result[name]
            assert got["resumed_losses"] == pytest.approx(ref_more[STEPS:], abs=2e-5, rel=0), (name, rank)
            for key, want in ref_after.items():
                torch.testing.assert_close(got["resumed_state"][key], want, atol=WEIGHT_ATOL, rtol=0,
                                           msg=f"{name} resumed, rank {rank} {key}")
        # The Lightning checkpoint holds the whole model under the module's keys: a plain process loads it.
        restored = CausalLMPipelineModule.load_from_checkpoint(results[0][name]["checkpoint"], map_location="cpu",
                                                               load="whole")
        for key, want in ref_state.items():
            torch.testing.assert_close(restored.state_dict()[key], want, atol=WEIGHT_ATOL, rtol=0,
                                       msg=f"{name} checkpoint {key}")


def test_tensor_degree_is_checked_by_name():
    from resihp_lightning.errors import ConfigError
    from resihp_lightning.strategy.options import StrategyOptions

    assert StrategyOptions(tensor_degree=2).tensor_degree == 2
    assert StrategyOptions(tensor_degree=2, fail_stop=True).fail_stop is not None  # a lost member is recovered
    # The layer-wise engine's ZeRO-1 runs under tensor parallelism; DeepSpeed's wrappers do not.
    assert StrategyOptions(tensor_degree=2, deepspeed_config={"zero_optimization": {"stage": 1}}).tensor_degree == 2
    for bad, pattern in (
        ({"tensor_degree": 0}, r"`tensor_degree`; allowed: an integer >= 1"),
        ({"tensor_degree": True}, r"`tensor_degree`; allowed: an integer >= 1"),
        ({"tensor_degree": 2, "deepspeed_config": {"zero_optimization": {"stage": 1, "layerwise": False}}},
         r"`tensor_degree`.*layer-wise engine"),
        ({"tensor_degree": 2, "deepspeed_config": {"bf16": {"enabled": True}}}, r"`tensor_degree`.*DeepSpeed's ZeRO / bf16"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            StrategyOptions(**bad)


def test_a_job_tensor_parallelism_cannot_run_yet_is_refused_by_name():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from resihp_lightning.errors import ConfigError
    from resihp_lightning.strategy.tensor_setup import check_tensor_parallel_job, create_tensor_groups
    from resihp_lightning.testing.toy_jobs import build_class

    error = MisconfigurationException
    plain = build_class()()  # a ResiHPModule without the tensor-parallel hooks
    with pytest.raises(error, match=r"needs \w+ to define pipeline_split_layer and pipeline_tensor_parallel_loss"):
        check_tensor_parallel_job(2, plain, {}, False, error)
    llm = _module(RUNS[0])
    check_tensor_parallel_job(2, llm, {}, True, error)  # passes
    with pytest.raises(error, match=r"plain fp32 optimizer.*bf16"):
        check_tensor_parallel_job(2, llm, {"bf16": {"enabled": True}}, False, error)
    with pytest.raises(error, match=r"`tensor_degree`; allowed: a divisor of the world size 4"):
        create_tensor_groups(3, 0, 4, llm, error)
    from resihp_lightning.strategy.options import StrategyOptions
    from resihp_lightning.strategy.plan_rules import initial_plan

    with pytest.raises(ConfigError, match=r"a divisor of the 2 tensor-parallel groups \(world size / tensor_degree 2\)"):
        initial_plan(StrategyOptions(tensor_degree=2, pipeline_degree=3), 2, 4)
