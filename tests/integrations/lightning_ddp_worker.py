"""One rank of a real 2-process Lightning DDP run with ReplayCallback (gloo, CPU).

Run by ``test_lightning.py::test_ddp_ranks_stay_equal_through_manual_backward`` as
``python -m tests.integrations.lightning_ddp_worker OUT``; Lightning's
``_SubprocessScriptLauncher`` starts rank 1 with the same command
(lightning/pytorch/strategies/launchers/subprocess_script.py, ``_call_children_scripts``,
lines 114-149). ``MASTER_PORT`` comes from the test (a free port picked at run time).

Every rank builds the same tiny Llama and the same four training batches;
``use_distributed_sampler`` (Lightning's default) gives rank 0 batches 0 and 2 and rank 1
batches 1 and 3, so the ranks' gradients differ and only the all-reduce keeps the replicas
equal. Each rank writes ``OUT/rank{r}.pt``: the policy before and after, the gradients of
the last step as the policy role left them (before ``opt.step``), the sequences it trained
on, the replay diagnostics of each step, and the strategy's backward after teardown.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import torch

from nemo_replay.integrations.lightning import ReplayCallback
from nemo_replay.objectives import TokenRatioObjective
from tests.integrations.test_lightning import TinyRL, _policy, _rollouts


class RecordingRL(TinyRL):
    """TinyRL that keeps what each rank saw and the gradients the policy role produced."""

    def __init__(self, policy):
        super().__init__(policy)
        self.seen, self.grads = [], None

    def training_step(self, micro, batch_idx):
        self.seen.append(torch.cat([m.sequences.flatten() for m in micro]))
        self.replay.recompute(self.policy, micro)
        self.replay.reference(self.reference, micro)
        opt = self.optimizers()
        opt.zero_grad()
        self.replay.policy(self.policy, micro)
        self.grads = [p.grad.detach().clone() for p in self.policy.parameters()]
        opt.step()
        self.records.append(dict(self.replay.last_metrics))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    policy = _policy()
    batches = _rollouts(policy, 4)
    before = [p.detach().clone() for p in policy.parameters()]
    module = RecordingRL(policy)
    callback = ReplayCallback("fsdp", loss_fn=TokenRatioObjective(kl_coef=0.1))
    trainer = lightning.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    trainer.fit(module, loader)
    torch.save(
        {
            "before": before,
            "after": [p.detach().clone() for p in module.policy.parameters()],
            "grads": module.grads,
            "seen": module.seen,
            "records": module.records,
            "backward_after_teardown": callback.roles.strategy.backward,
            "world_size": trainer.world_size,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
