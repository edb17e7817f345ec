"""Recorded MoE routes in the narrow dtypes engines send (uint8 ids fit 256 experts)."""

import pytest
import torch

from nemo_replay.strategies.megatron.routing import check_recorded_routes
from nemo_replay.support.packed import PackedTensor


def _config(num_experts: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=num_experts, moe_router_topk=2,
        use_cpu_initialization=True,
    )


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_routes_of_a_256_expert_model_pass_in_every_integer_dtype(dtype):
    config = _config(256)
    # Two trajectories of 3 and 2 tokens, two MoE layers, top-2; ids up to 255, the largest uint8.
    segs = [torch.tensor([[[0, 255], [17, 200]]] * 3), torch.tensor([[[254, 1], [128, 3]]] * 2)]
    check_recorded_routes(PackedTensor.from_segments([s.to(dtype) for s in segs]), config, micro_batch=0)


def test_out_of_range_routes_are_still_refused_in_narrow_dtypes():
    # 200 experts: uint8 id 230 is outside [0, 200) and must be named, not wrapped.
    segs = [torch.zeros(3, 2, 2, dtype=torch.uint8), torch.zeros(2, 2, 2, dtype=torch.uint8)]
    segs[1][1, 0, 1] = 230
    with pytest.raises(ValueError, match=r"trajectory 1, token position 1, MoE layer 0: recorded experts \[0, 230\].*num_moe_experts=200"):
        check_recorded_routes(PackedTensor.from_segments(segs), _config(200), micro_batch=0)
    segs = [torch.zeros(3, 2, 2, dtype=torch.int16), torch.full((2, 2, 2), -1, dtype=torch.int16)]
    with pytest.raises(ValueError, match=r"trajectory 1, token position 0, MoE layer 0: recorded experts \[-1, -1\]"):
        check_recorded_routes(PackedTensor.from_segments(segs), _config(256), micro_batch=0)
