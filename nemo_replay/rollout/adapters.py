"""Moved: engine adapters are one module per engine."""

raise ImportError(
    "nemo_replay.rollout.adapters moved: vLLM adapters are in nemo_replay.rollout.vllm "
    "(support_from_vllm_logprobs, support_from_vllm_sampling_mask, support_from_vllm_output, "
    "support_from_vllm_generate), SGLang adapters in nemo_replay.rollout.sglang "
    "(support_from_sglang_meta_info, support_from_sglang_response), and EngineSupport / "
    "capture_settings_from_engine in nemo_replay.rollout.engine"
)
