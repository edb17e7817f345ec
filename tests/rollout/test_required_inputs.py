"""Required inputs of the rollout side's public functions: None or a wrong kind is a ValueError naming it.

A check written as ``if x is not None: check(x)`` lets a missing required argument through to
an AttributeError deep inside, or to a silent default. Each case below failed that way before.
"""

import pytest
import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.rollout.transport.client import GenerateClient
from nemo_replay.rollout.collate import collate_routes, collate_support
from nemo_replay.rollout.transport.server import GenerateServer
from nemo_replay.rollout.engines.sglang import support_from_sglang_meta_info
from nemo_replay.rollout.capture.trace import RouteTrace, SupportTrace, TokenAlignedAccumulator
from nemo_replay.rollout.engines.vllm import support_from_vllm_sampling_mask
from nemo_replay.rollout.transport.wire import WireError, decode_envelope, encode_array, support_to_wire
from nemo_replay.support.packed import PackedTensor

ROWS = torch.tensor([[5, 1], [9, -1]], dtype=torch.int32)

CASES = [
    (lambda: validate_support(None, where="here"), ValueError, "here: support must be"),
    (lambda: validate_support(ROWS, sampled_ids=torch.tensor([5.2, 9.0]), where="here"), ValueError, "sampled_ids have dtype torch.float32"),
    (lambda: SupportTrace(top_k=2).add_turn(None, ROWS), ValueError, "token ids are required, got None"),
    (lambda: collate_support([ROWS], response_lengths=None), ValueError, "response lengths are required"),
    (lambda: collate_support([ROWS], response_lengths=[2.0]), ValueError, "response lengths have dtype torch.float32"),
    (lambda: collate_routes([torch.zeros(2, 1, 1, dtype=torch.int32)], sequence_lengths=None), ValueError, "sequence lengths are required"),
    (lambda: TokenAlignedAccumulator((2,), None), ValueError, "dtype=None, expected a torch.dtype"),
    (lambda: TokenAlignedAccumulator(None, torch.int32), ValueError, "row_shape=None"),
    (lambda: RouteTrace(num_layers=None, topk=2), ValueError, "num_layers=None"),
    (lambda: encode_array(None), WireError, "expected a tensor or numpy array, got NoneType"),
    (lambda: support_to_wire(None), WireError, "support must be a PackedTensor, a RaggedSupport or int"),
    (lambda: decode_envelope(None), WireError, "expected an envelope object"),
    (lambda: GenerateServer(None, vocab_size=8), ValueError, "logits_fn .* must be callable"),
    (lambda: GenerateServer(lambda t: t, vocab_size=None), ValueError, "vocab_size=None"),
    (lambda: GenerateClient(None), ValueError, "base_url=None"),
    # A row width of 0 flagged every position, 2.0 failed in indexing, True passed as 1.
    (lambda: support_from_vllm_sampling_mask([[5, 1]], [5], width=0), ValueError, r"vLLM sampling-mask adapter: width=0; expected an int >= 1"),
    (lambda: support_from_vllm_sampling_mask([[5, 1]], [5], width=2.0), ValueError, r"width=2.0; expected an int >= 1 .* or None"),
    (lambda: support_from_sglang_meta_info({"output_token_sampling_mask": [[5, 1]]}, [5], width=True), ValueError, r"SGLang sampling-mask adapter: width=True"),
    # Sampled log-probs carried along with a mask: one per token, or they misalign (a list was kept as is).
    (lambda: support_from_vllm_sampling_mask([[5, 1], [9]], [5, 9], logprobs=torch.tensor([-0.1])), ValueError, r"logprobs must be a float \(2,\) tensor, .* got torch.float32 \(1,\)"),
    (lambda: support_from_vllm_sampling_mask([[5, 1], [9]], [5, 9], logprobs=[-0.1, -0.2]), ValueError, r"logprobs must be a float \(2,\) tensor, .* got list"),
]


@pytest.mark.parametrize("call, error, match", CASES, ids=[m.split(":")[0][:40] for _, _, m in CASES])
def test_required_inputs_are_checked(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_checked_paths_still_accept_good_input():
    validate_support(PackedTensor(ROWS, [0, 2]), sampled_ids=torch.tensor([1, 9]), where="here")
    out = collate_support([ROWS], response_lengths=[2], sampled_ids=[torch.tensor([5, 9])])
    assert out.values.tolist() == ROWS.tolist()
    assert decode_envelope({"data": "AQI=", "shape": [2], "dtype": "uint8"}).tolist() == [1, 2]
    rows = support_from_vllm_sampling_mask([[5, 1], [9], [2, 7, 3]], [1, 9, 3], width=2)
    assert rows.support.to_padded().values.tolist() == [[5, 1], [9, -1], [-1, -1]] and rows.flagged.tolist() == [False, False, True]
