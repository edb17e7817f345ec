"""GRPO with replay in a LightningModule: transformers' generate -> ReplayBatch -> the three roles.

    python examples/lightning_replay.py            # 4 steps on CPU, a tiny Llama built from a config
    python examples/lightning_replay.py --steps 20 --no-replay   # the full-vocabulary path, same loop

Each training step samples with ``generate_with_support`` (transformers' ``generate`` with
the support of every token recorded after its top-k / top-p warpers), scores the
completions on the built-in successor task, turns the generation into micro-batches with
``replay_batches_from_generation``, and runs the roles ``ReplayCallback`` attached:
recompute (old log-probs, and the mismatch against the sampler), reference, policy
(objective and backward through ``manual_backward``). Nothing is downloaded. The last line
printed is a JSON summary (one value per step).
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import lightning
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from nemo_replay.integrations.lightning import ReplayCallback
from nemo_replay.objectives import group_advantages
from nemo_replay.rollout.capture.hf import generate_with_support
from nemo_replay.trainer.generation import replay_batches_from_generation
from nemo_replay.objectives import TokenRatioObjective
from nemo_replay.trainer.tasks import SuccessorTask
from nemo_replay.trainer.generation import left_pad

V, NUM_PROMPTS, GROUP, NEW_TOKENS = 16, 4, 4, 6


class ReplayGRPO(lightning.LightningModule):
    """One GRPO step per batch of prompts: sample, reward, then the replay roles."""

    def __init__(self, policy, task: SuccessorTask, generation_config: GenerationConfig, micro_batch_size: int):
        super().__init__()
        self.automatic_optimization = False  # the policy role runs backward (through manual_backward)
        self.policy = policy
        self.reference = copy.deepcopy(policy).requires_grad_(False)
        self.task, self.generation_config, self.micro_batch_size = task, generation_config, micro_batch_size
        self.history = []

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask = batch  # GROUP copies of each prompt, left-padded
        out = generate_with_support(self.policy, input_ids, attention_mask, self.generation_config)
        prompts = [row[mask] for row, mask in zip(input_ids, attention_mask.bool())]
        rewards = self.task.rewards(prompts, out.completions)
        micro = replay_batches_from_generation(
            out, input_ids, attention_mask, advantages=group_advantages(rewards, GROUP),
            micro_batch_size=self.micro_batch_size,
        )
        self.replay.recompute(self.policy, micro)  # old log-probs; mismatch vs the sampler's
        self.replay.reference(self.reference, micro)
        opt = self.optimizers()
        opt.zero_grad()
        self.replay.policy(self.policy, micro)
        opt.step()
        metrics = self.replay.last_metrics
        self.history.append(dict(reward=float(rewards.mean()), loss=float(metrics["loss"]),
                                 mismatch_max=float(metrics["mismatch_max"]), kl=float(metrics["kl"])))
        print(f"step {batch_idx}: " + ", ".join(f"{k} {v:.4g}" for k, v in self.history[-1].items()), flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=3e-3)


def prompt_batches(task: SuccessorTask, steps: int, seed: int) -> list:
    """``steps`` batches of NUM_PROMPTS prompts, each repeated GROUP times (a GRPO group), left-padded."""
    g = torch.Generator().manual_seed(seed)
    return [left_pad([p for p in task.prompts(NUM_PROMPTS, g) for _ in range(GROUP)]) for _ in range(steps)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-replay", action="store_true", help="score the full vocabulary (the previous behaviour)")
    args = parser.parse_args(argv)

    lightning.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    policy = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    ))
    # Sampling as a real run would: top-k and top-p truncate, so replay matters.
    generation_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=8, top_p=0.95, max_new_tokens=NEW_TOKENS, pad_token_id=0,
    )
    task = SuccessorTask(V, 2, 5, NEW_TOKENS)
    callback = ReplayCallback("fsdp", loss_fn=TokenRatioObjective(kl_coef=0.01), enabled=not args.no_replay)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )
    module = ReplayGRPO(policy, task, generation_config, micro_batch_size=NUM_PROMPTS * GROUP // 2)
    loader = torch.utils.data.DataLoader(prompt_batches(task, args.steps, seed=1), batch_size=None)
    trainer.fit(module, loader)
    summary = {key: [h[key] for h in module.history] for key in ("reward", "loss", "mismatch_max", "kl")}
    summary["replay"] = not args.no_replay
    summary["finite"] = all(math.isfinite(v) for values in summary.values() if isinstance(values, list) for v in values)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
