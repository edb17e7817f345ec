"""Recording supports where tokens are sampled (docs/design.md §7): the sampler, transformers' generate, multi-turn traces."""
