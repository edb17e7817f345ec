"""The reference trainer's model backends: a Hugging Face model under FSDP2 (:mod:`.hf`),
megatron-core's ``GPTModel`` (:mod:`.megatron`), and the rollout engine that samples with
transformers' ``generate`` on a copy of the policy's weights (:mod:`.hf_engine`)."""
