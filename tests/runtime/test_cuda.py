"""ResiHPStrategy on a CUDA device with NCCL (skipped without CUDA).

A single-GPU machine allows one rank only (NCCL refuses two ranks on one GPU), so this checks the
device paths one rank can reach: the engine on the GPU with the NCCL process group, batches moved
to the device, the profiler's CUDA events, checkpoints, predict, and bf16 / fp16 + ZeRO-1 (fp16 is
GPU-only in DeepSpeed). Multi-rank NCCL (point-to-point migration) needs a machine with several GPUs.
"""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.testing.toy_jobs import M, MBS, build_model, make_loader, make_predict_loader, make_recorder, make_trainer, reference_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 4


def _cuda_rank(rank: int, world: int, config: dict) -> dict:
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    recorder = make_recorder()
    strategy = ResiHPStrategy(micro_batch_size=MBS, deepspeed_config=config)
    trainer = make_trainer(strategy, world, STEPS, callbacks=[recorder], accelerator="gpu")
    trainer.fit(build_model(), make_loader())
    predictions = trainer.predict(trainer.lightning_module, make_predict_loader())
    stats = recorder.stats[-1]
    return {
        "backend": strategy._get_process_group_backend(),
        "device": str(strategy.root_device),
        "losses": recorder.losses,
        "busy_ms": [mb.compute_ms for mb in stats.micro_batches],
        "prediction_device": str(predictions[0].device),
        "state": {k: v.float().cpu() for k, v in strategy.lightning_module_state_dict().items()},
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("config", "tolerance"),
    [({}, 1e-5), ({"bf16": {"enabled": True}}, 5e-2), ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, 5e-2)],
    ids=["fp32", "bf16", "fp16-zero1"],
)
def test_one_gpu_trains_like_the_cpu_reference(distributed, config, tolerance):
    (result,) = distributed(_cuda_rank, 1, timeout=300, config=config)
    ref_losses, ref_params = reference_run(STEPS)
    assert result["backend"] == "nccl" and result["device"].startswith("cuda")
    assert result["prediction_device"].startswith("cuda")
    assert len(result["busy_ms"]) == M and all(ms > 0 for ms in result["busy_ms"])
    assert result["losses"] == pytest.approx(ref_losses, abs=tolerance, rel=0)
    for key, want in ref_params.items():
        assert torch.allclose(result["state"][key], want, atol=max(tolerance, 1e-5) * 10, rtol=0), key
