"""nemo_replay.rollout: the rollout side of support-conditioned replay (docs/design.md §7).

Three rooms and two checkpoints between them and the trainer:

- :mod:`~nemo_replay.rollout.capture`: recording supports where tokens are sampled --
  :mod:`~.capture.sampler` (the support-recording sampler, also ``nemo_replay.capture``),
  :mod:`~.capture.hf` (transformers' ``generate``), :mod:`~.capture.trace` (multi-turn
  support and route (R3) traces).
- :mod:`~nemo_replay.rollout.engines`: reading supports from what an engine returns --
  :mod:`~.engines.base` (what every adapter returns, flagged positions), :mod:`~.engines.vllm`
  (vLLM 0.33), :mod:`~.engines.sglang` (SGLang 0.5.23 ``/generate``).
- :mod:`~nemo_replay.rollout.transport`: moving rows between processes --
  :mod:`~.transport.wire` (base64 array envelopes in JSON bodies), :mod:`~.transport.binary`
  (binary bodies: a JSON head and the arrays' raw bytes), :mod:`~.transport.client`
  (async generate client with retries), :mod:`~.transport.server` (loopback generate endpoint).
- :mod:`~nemo_replay.rollout.boundary`: the support checks where rollout data enters.
- :mod:`~nemo_replay.rollout.collate`: per-trajectory rows -> trainer batches.

Importing this package imports none of them; aiohttp is needed only by the client and server.
"""
