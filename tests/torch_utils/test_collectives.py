"""The object collectives (:mod:`resihp_lightning.torch_utils.collectives`) in a single process: with no
process group, or a world of one, a process answers for itself."""

from __future__ import annotations

import torch.distributed as dist

from resihp_lightning.torch_utils.collectives import all_gather_objects, broadcast_from_zero


def _check_answers_for_itself():
    obj = {"step": 3, "losses": [1.5, 2.0]}
    gathered = all_gather_objects(obj)
    assert gathered == [obj] and gathered[0] is obj
    assert broadcast_from_zero(obj) is obj
    assert all_gather_objects(None) == [None]


def test_without_a_process_group_a_process_answers_for_itself():
    assert not dist.is_initialized()
    _check_answers_for_itself()


def test_in_a_world_of_one_a_process_answers_for_itself(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _check_answers_for_itself()
    finally:
        dist.destroy_process_group()
