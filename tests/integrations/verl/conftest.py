"""Fixtures for the verl 0.9.1 tests: a tiny model folder verl can load, and verl's composed config.

Nothing here imports verl at collection; each test module skips itself when verl is absent
(``pytest.importorskip``), so the main environment (transformers outside verl's range)
collects and skips them. Run them with the environment ``.ci/run`` builds for verl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: The tiny vocabulary: chat markers, a tool-call grammar, a few words. Ids are list positions.
TOKENS = [
    "<pad>", "<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
    "</tool_response>", "system", "user", "assistant", "tool", "{", "}", ":", ",", '"name"', '"arguments"',
    '"calc"', '"x"', "1", "2", "3", "hello", "world", "add", "the", "numbers", "result", "is", "ok", "yes", "no",
    "maybe", "red", "green", "blue", "cat", "dog",
]
SPECIAL = ["<pad>", "<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# A ChatML-like template rendered with spaces between words (the tokenizer splits on whitespace).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['role'] == 'tool' %}<tool_response> {{ m['content'] }} </tool_response>{% else %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %} <tool_call> { \"name\" : \"{{ c['function']['name'] }}\" , "
    "\"arguments\" : { } } </tool_call>{% endfor %}{% endif %} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_model_dir(path: Path) -> Path:
    """A folder ``HFModelConfig`` loads: ``config.json`` of a 2-layer Llama and a word-level
    tokenizer with the chat template above (no weights: the rollout side never builds the model)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, architectures=["LlamaForCausalLM"],
        bos_token_id=2, eos_token_id=4, pad_token_id=0,
    ).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 4, "pad_token_id": 0}))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("verl_tiny_model"))
