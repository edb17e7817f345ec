"""Reading supports from what an inference engine returns (docs/design.md §7): vLLM and SGLang adapters."""
