"""The built-in task: a verifiable reward a tiny model learns within one CPU run.

``successor``: the prompt counts up from a random start, ``a, a+1, ..., a+P-1`` (mod V);
the response should keep counting. The reward of a response is the fraction of its
``max_new_tokens`` positions whose token is the previous token plus one (mod V), the
previous token of the first response position being the last prompt token. Example with
V = 32, prompt ``[30, 31]`` and four response tokens::

    response  [0, 1, 5, 6]   0 = 31+1 mod 32 ok, 1 ok, 5 != 2, 6 = 5+1 ok  -> reward 3/4

A randomly initialised model scores about 1/V; the rule is a bigram, so the policy picks it
up within a few hundred GRPO updates, which makes the reward curve a quick health check of
the whole loop.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SuccessorTask", "TASKS", "build_task"]


class SuccessorTask:
    """Continue a counting sequence (see the module doc).

    Args:
        vocab_size: V; every token id is in [0, V).
        min_prompt_len, max_prompt_len: prompt lengths are drawn uniformly from this range.
        response_len: the number of positions a full response has (``generation.max_new_tokens``).
    """

    name = "successor"

    def __init__(self, vocab_size: int, min_prompt_len: int, max_prompt_len: int, response_len: int):
        if vocab_size < 2 or not 1 <= min_prompt_len <= max_prompt_len or response_len < 1:
            raise ValueError(
                f"successor task needs vocab_size >= 2, 1 <= min_prompt_len <= max_prompt_len and "
                f"response_len >= 1; got {vocab_size}, {min_prompt_len}, {max_prompt_len}, {response_len}"
            )
        self.vocab_size = vocab_size
        self.min_prompt_len = min_prompt_len
        self.max_prompt_len = max_prompt_len
        self.response_len = response_len

    def prompts(self, num_prompts: int, generator: torch.Generator) -> list[torch.Tensor]:
        """``num_prompts`` prompts, each (P_i,) int64, drawn with ``generator`` (a CPU generator)."""
        lengths = torch.randint(self.min_prompt_len, self.max_prompt_len + 1, (num_prompts,), generator=generator)
        starts = torch.randint(0, self.vocab_size, (num_prompts,), generator=generator)
        return [(int(s) + torch.arange(int(n))) % self.vocab_size for s, n in zip(starts, lengths)]

    def rewards(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> torch.Tensor:
        """Reward of each (prompt, response) pair: (len(prompts),) float32 in [0, 1]."""
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
        out = torch.zeros(len(prompts), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            r = r.detach().cpu().long()
            prev = torch.cat([p.detach().cpu().long()[-1:], r[:-1]])
            out[i] = ((r == (prev + 1) % self.vocab_size).sum() / self.response_len).item()
        return out


TASKS = {"successor": SuccessorTask}


def build_task(name: str, *, vocab_size: int, min_prompt_len: int, max_prompt_len: int, response_len: int):
    """The built-in task ``name``; unknown names list the available ones."""
    if name not in TASKS:
        raise ValueError(f"task.name={name!r} is not a built-in task; choose one of {', '.join(sorted(TASKS))}")
    return TASKS[name](vocab_size, min_prompt_len, max_prompt_len, response_len)
