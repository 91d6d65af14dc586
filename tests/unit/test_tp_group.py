"""TP process groups (voltserve.distributed.group): the single-rank no-ops, gloo collectives on 2 CPU ranks, and
the configuration errors."""

from __future__ import annotations

import pytest
import torch

from tests.tp_ranks import run_ranks
from voltserve.distributed import SingleRank, check_tp_devices, init_tp_group
from voltserve.errors import ConfigError


def test_single_rank_is_a_no_op():
    tp = init_tp_group(0, 1, "unused://")
    assert isinstance(tp, SingleRank) and (tp.rank, tp.world_size) == (0, 1)
    x = torch.arange(6.0).view(2, 3)
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x


def collectives(tp) -> dict:
    x = torch.full((2, 3), float(tp.rank + 1))
    x[0, 0] = 10.0 ** tp.rank
    tp.all_reduce(x)
    return {"rank": tp.rank, "world": tp.world_size, "sum": x,
            "gather": tp.all_gather(torch.tensor([[tp.rank, 10 * tp.rank]]), dim=1)}


def test_gloo_two_ranks(tmp_path):
    ranks = run_ranks(2, collectives, (), tmp_path)
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    want = torch.tensor([[11.0, 3, 3], [3, 3, 3]])  # 1 + 10 at [0, 0], 1 + 2 elsewhere
    for r in ranks:
        assert torch.equal(r["sum"], want)
        assert torch.equal(r["gather"], torch.tensor([[0, 0, 1, 10]]))


def test_config_errors():
    with pytest.raises(ConfigError, match="tp rank 2 is outside 0..1"):
        init_tp_group(2, 2, "unused://")
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1, not 0"):
        check_tp_devices(0, "cpu")
    with pytest.raises(ConfigError, match="must be cpu or cuda, not 'tpu'"):
        check_tp_devices(2, "tpu")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ConfigError, match=r"tensor_parallel_size 64 needs 64 GPUs, \d+ visible"):
            check_tp_devices(64, "cuda")
    check_tp_devices(8, "cpu")  # CPU ranks: any number


def test_engine_config_tensor_parallel_size():
    from voltserve.config import EngineConfig

    assert EngineConfig().validate().tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1, not 0"):
        EngineConfig(tensor_parallel_size=0).validate()
    assert EngineConfig(tensor_parallel_size=2).validate().tensor_parallel_size == 2  # heads checked at build
