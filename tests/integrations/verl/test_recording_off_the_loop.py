"""verl's vLLM server reads a response's supports off its event loop.

``RecordingVllmEngine`` wraps verl's ``AsyncLLM`` (``vllm_async_server.py``): it passes the
engine's stream through and reads the finished response's rows. Read on the event loop, one
4096-token response at k = 64 held every other request of that server for 1.6-2.0 s (vLLM's own
output handler yields every chunk, ``v1/engine/async_llm.py:654-683``). Here the engine is a
stream of the ``RequestOutput`` vLLM builds (``tests/rollout/engines/engine_outputs.py``, field
for field), the recorder is replay's own, and a ticker on the same loop measures the longest
gap while the rows are read. Needs no verl: the module imports without it.
"""

from __future__ import annotations

import asyncio

import torch

from nemo_replay.integrations.verl.rollout import RecordingVllmEngine, RolloutReplay, VllmSupportRecorder
from tests.rollout.engines.engine_outputs import RequestOutput, vllm_offline_output, vllm_steps

K, V, N = 64, 4096, 1024  # four READ_CHUNKs


class _Params:
    """The ``SamplingParams`` fields the recorder reads and sets (vllm/sampling_params.py)."""

    def __init__(self):
        self.temperature, self.top_k, self.top_p, self.min_p = 1.0, K, 1.0, 0.0
        self.repetition_penalty, self.presence_penalty, self.frequency_penalty = 1.0, 0.0, 0.0
        self.logprobs, self.flat_logprobs = 0, False


class _Engine:
    def __init__(self, final):
        self.final = final

    async def generate(self, *args, sampling_params, request_id, **kwargs):
        yield self.final


def test_a_long_response_is_read_off_the_event_loop():
    import threading

    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(0)) * 3
    steps = vllm_steps(logits, 1.0, top_k=K, num_logprobs=K + 1)
    final = RequestOutput("r", None, [1, 2], None, [vllm_offline_output(steps, K + 1)], True)
    threads = []

    class Recorder(VllmSupportRecorder):
        def read(self, completion, sampling_params):
            threads.append(threading.get_ident())
            return super().read(completion, sampling_params)

    sink: dict = {}
    engine = RecordingVllmEngine(_Engine(final), Recorder(RolloutReplay(True, K, 1.0, K, 1.0), vocab_size=V), sink)
    params = _Params()

    async def run():
        loop_thread = threading.get_ident()
        outputs = [o async for o in engine.generate("p", sampling_params=params, request_id="r")]
        return loop_thread, outputs

    loop_thread, outputs = asyncio.run(run())
    assert outputs == [final]  # the engine's stream, unchanged
    assert threads and all(t != loop_thread for t in threads)  # read in a worker thread, not on the loop
    rows, flags = sink["r"]
    assert rows.num_rows == N and rows.width_bound <= K and not flags  # CSR rows, one a generated token
    assert [sorted(rows.row(j).tolist()) for j in range(N)] == [s.mask for s in steps]
    assert params.logprobs == K + 1 and params.flat_logprobs is True  # asked on the request, flat where vLLM has it
