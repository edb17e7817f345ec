"""Whether a Hugging Face causal LM's logits are ``hidden @ W.T``: the one rule for hidden mode.

Hidden mode (docs/design.md §4) scores from the backbone's last hidden states and the
LM-head weight, never building logits; that reproduces the model only when its logits are
exactly that product. Used by the fsdp strategy and the TRL trainer alike, so a model is
accepted or refused the same way by both.
"""

from __future__ import annotations

import torch

__all__ = ["LOGIT_SCALES", "hidden_mode_problems"]

#: Config attributes (of the text config) that change logits after the LM head's product, with the
#: value that leaves them unchanged: Gemma 2/3 soft-capping, Cohere's logit_scale, Granite's
#: logits_scaling, MiniCPM-style output / lm_head multipliers.
LOGIT_SCALES = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "output_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
}


def hidden_mode_problems(model) -> list[str]:
    """One line per reason ``model``'s logits are not ``hidden @ W.T`` (empty: hidden mode reproduces them).

    Args:
        model: a transformers ``PreTrainedModel`` (unwrapped from accelerate / PEFT by the caller;
            FSDP2's ``fully_shard`` keeps the head a ``nn.Linear``).
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    out = []
    for name, neutral in LOGIT_SCALES.items():
        value = getattr(text, name, None)
        if value is not None and value != neutral:
            out.append(f"the model's {name}={value} makes its logits differ from hidden @ W.T")
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        out.append(f"{type(model).__name__} has no output embedding (LM head) weight")
    elif not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        out.append(f"the LM head is a {type(head).__name__}, not a plain nn.Linear (an adapter or a custom forward)")
    elif head.bias is not None:
        out.append("the LM head has a bias, which hidden mode does not add")
    return out
