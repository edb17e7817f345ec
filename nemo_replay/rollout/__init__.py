"""nemo_replay.rollout: the rollout side of support-conditioned replay (docs/design.md §7).

One concept per module:

- :mod:`~nemo_replay.rollout.capture`  the support-recording sampler (also ``nemo_replay.capture``)
- :mod:`~nemo_replay.rollout.engine`   what every engine adapter returns (flagged positions)
- :mod:`~nemo_replay.rollout.vllm`     vLLM 0.33 outputs -> support rows (masks, processed log-probs)
- :mod:`~nemo_replay.rollout.sglang`   SGLang 0.5.23 ``/generate`` outputs -> support rows
- :mod:`~nemo_replay.rollout.hf`       support capture from transformers' ``generate``
- :mod:`~nemo_replay.rollout.boundary` support checks where rollout data enters
- :mod:`~nemo_replay.rollout.trace`    multi-turn support and route (R3) traces
- :mod:`~nemo_replay.rollout.wire`     base64 array envelopes in JSON bodies
- :mod:`~nemo_replay.rollout.client`   async generate client with retries (needs aiohttp)
- :mod:`~nemo_replay.rollout.server`   loopback generate endpoint (needs aiohttp)
- :mod:`~nemo_replay.rollout.collate`  per-trajectory rows -> trainer batches

Importing this package imports none of them; aiohttp is needed only by client and server.
"""
