"""ReplayCallback switches replay on for a LightningModule trained by lightning.Trainer."""

from __future__ import annotations

import copy

import lightning
import pytest
import torch

from nemo_replay.objectives import group_advantages
from nemo_replay.strategies.base import RoleSettings
from nemo_replay.layout.canonical import position_ids
from nemo_replay.trainer.generation import SamplingSettings, generate
from nemo_replay.integrations.lightning import ReplayCallback
from nemo_replay.tasks import SuccessorTask

V, G = 24, 4


def _policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    ))


def _rollouts(model, num_batches: int):
    """Training batches: each a list of two micro-batches of GRPO rollouts (with support)."""
    task = SuccessorTask(V, 2, 4, 4)
    g = torch.Generator().manual_seed(1)

    def logits(seq, mask):
        with torch.no_grad():
            return model(input_ids=seq, attention_mask=mask.long(), position_ids=position_ids(mask), use_cache=False).logits[:, -1]

    out = []
    for _ in range(num_batches):
        prompts = [p for p in task.prompts(2, g) for _ in range(G)]
        ro = generate(logits, prompts, SamplingSettings(1.0, 6, 0.9, 0.0, 4), generator=g)
        ro.batch.advantages = group_advantages(task.rewards(ro.prompts, ro.responses), G)
        out.append([ro.batch.select(torch.arange(0, G)), ro.batch.select(torch.arange(G, 2 * G))])
    return out


class TinyRL(lightning.LightningModule):
    def __init__(self, policy, manual: bool = True):
        super().__init__()
        self.automatic_optimization = not manual
        self.policy = policy
        self.reference = copy.deepcopy(policy).requires_grad_(False)
        self.records = []

    def training_step(self, micro, batch_idx):
        self.replay.recompute(self.policy, micro)
        self.replay.reference(self.reference, micro)
        opt = self.optimizers()
        opt.zero_grad()
        self.replay.policy(self.policy, micro)
        opt.step()
        self.records.append(dict(self.replay.last_metrics))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=1e-2)


def _fit(module, batches, callback):
    trainer = lightning.Trainer(
        max_steps=len(batches), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    trainer.fit(module, loader)
    return trainer


@pytest.mark.parametrize("enabled", [True, False])
def test_callback_runs_the_roles_inside_lightning(enabled):
    policy = _policy()
    batches = _rollouts(policy, 2)
    module = TinyRL(policy)
    trainer = _fit(module, batches, ReplayCallback("fsdp", settings=RoleSettings(kl_coef=0.1), enabled=enabled))
    first, second = module.records
    if enabled:
        assert first["mismatch_max"] < 1e-5 and first["ratio_max_dev"] < 1e-5
    else:
        assert first["mismatch_mean"] > 1e-2 and first["ratio_max_dev"] > 1e-2
    # The rollouts of batch 2 came from the weights before the first update.
    assert second["mismatch_max"] > 1e-4
    assert "replay/ratio_max_dev" in trainer.callback_metrics


def test_callback_refuses_automatic_optimization_and_batches_without_support():
    policy = _policy()
    batches = _rollouts(policy, 1)
    with pytest.raises(ValueError, match="automatic_optimization = False"):
        _fit(TinyRL(policy, manual=False), batches, ReplayCallback())
    batches[0][1].support = None
    with pytest.raises(ValueError, match="training batch 0, micro-batch 1: replay is on but"):
        _fit(TinyRL(policy), batches, ReplayCallback())


def test_callback_hands_the_policy_role_the_modules_objective():
    from nemo_replay.objectives import SequenceRatioObjective

    calls = []

    class Recorded:
        """GSPO, recording what the policy role hands it."""

        objective = SequenceRatioObjective(clip_eps=0.1, kl_coef=0.05)

        def check(self, batch):
            return self.objective.check(batch)

        def __call__(self, logprobs, batch, mask):
            calls.append((tuple(logprobs.shape), tuple(batch.loss_mask.shape), logprobs.requires_grad, bool(mask.any())))
            return self.objective(logprobs, batch, mask)

    policy = _policy()
    batches = _rollouts(policy, 1)
    module = TinyRL(policy)
    _fit(module, batches, ReplayCallback("fsdp", settings=RoleSettings(kl_coef=0.1), loss_fn=Recorded()))
    assert len(calls) == 2  # one call per micro-batch
    assert all(shape == mask_shape and grad and active for shape, mask_shape, grad, active in calls)
    assert module.records[0]["kl"] >= 0 and module.records[0]["mismatch_max"] < 1e-5
