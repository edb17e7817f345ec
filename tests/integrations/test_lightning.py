"""ReplayCallback switches replay on for a LightningModule trained by lightning.Trainer."""

from __future__ import annotations

import copy

import lightning
import pytest
import torch

from nemo_replay.objectives import TokenRatioObjective, group_advantages
from nemo_replay.layout.canonical import position_ids
from nemo_replay.trainer.generation import SamplingSettings, generate
from nemo_replay.integrations.lightning import ReplayCallback
from nemo_replay.trainer.tasks import SuccessorTask

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
    trainer = _fit(module, batches, ReplayCallback("fsdp", loss_fn=TokenRatioObjective(kl_coef=0.1), enabled=enabled))
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
    _fit(module, batches, ReplayCallback("fsdp", loss_fn=Recorded()))
    assert len(calls) == 2  # one call per micro-batch
    assert all(shape == mask_shape and grad and active for shape, mask_shape, grad, active in calls)
    assert module.records[0]["kl"] >= 0 and module.records[0]["mismatch_max"] < 1e-5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_ranks_stay_equal_through_manual_backward(tmp_path):
    """Lightning DDP, 2 CPU ranks (gloo): the policy role's backward reaches DDP's reducer.

    Lightning prepares DDP's reducer only in ``manual_backward`` under manual optimization
    (lightning/pytorch/strategies/ddp.py:315-321, ``DDPStrategy.pre_backward``); a plain
    ``loss.backward()`` left each rank with its own gradients and the replicas drifted.
    One spawn (tests/integrations/lightning_ddp_worker.py) checks all of it.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.lightning_ddp_worker", str(tmp_path)], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2
    # The ranks trained on different batches (Lightning's DistributedSampler), from the same weights.
    assert len(r0["seen"]) == len(r1["seen"]) == 2
    assert not any(torch.equal(a, b) for a, b in zip(r0["seen"], r1["seen"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["before"], r1["before"]))
    # The gradients the policy role left were all-reduced: equal on both ranks, so the replicas are
    # (without it, measured: last gradients 0.29 apart, parameters 0.027 apart after a 0.020 move).
    grad_gap = max(float((a - b).abs().max()) for a, b in zip(r0["grads"], r1["grads"]))
    gap = max(float((a - b).abs().max()) for a, b in zip(r0["after"], r1["after"]))
    moved = max(float((a - b).abs().max()) for a, b in zip(r0["after"], r0["before"]))
    assert grad_gap == 0.0 and gap == 0.0 and moved > 1e-3, dict(grad_gap=grad_gap, param_gap=gap, moved=moved)
    # Replay ran on each rank with the weights that sampled, and the callback restored the strategy.
    assert r0["records"][0]["mismatch_max"] < 1e-5 and r1["records"][0]["mismatch_max"] < 1e-5
    assert r0["backward_after_teardown"] is None and r1["backward_after_teardown"] is None


def test_module_docstring_example_runs_as_written(tmp_path, monkeypatch):
    """The callback's docstring example, executed verbatim with a policy, a reference and a loader."""
    import textwrap

    import nemo_replay.integrations.lightning as module_under_test

    doc = module_under_test.__doc__
    start = doc.index("::\n") + 3
    block = []
    for line in doc[start:].splitlines():
        if line and not line.startswith("    "):
            break
        block.append(line)
    code = textwrap.dedent("\n".join(block))
    assert "def configure_optimizers" in code and "trainer.fit(" in code
    policy = _policy()
    monkeypatch.chdir(tmp_path)  # the default Trainer writes lightning_logs/ and checkpoints here
    loader = torch.utils.data.DataLoader(_rollouts(policy, 1), batch_size=None, collate_fn=lambda b: b)
    namespace = {"policy": policy, "reference": copy.deepcopy(policy), "loader": loader}
    before = [p.detach().clone() for p in policy.parameters()]
    exec(compile(code, module_under_test.__file__ + ":__doc__", "exec"), namespace)
    assert namespace["trainer"].global_step == 1
    assert any(not torch.equal(a, p) for a, p in zip(before, policy.parameters()))


def test_replay_batches_from_generation_feed_the_roles():
    """generate_with_support -> replay_batches_from_generation -> recompute reproduces the sampler."""
    from transformers import GenerationConfig

    from nemo_replay.roles import ReplayRoles
    from nemo_replay.rollout.capture.hf import generate_with_support
    from nemo_replay.trainer.generation import replay_batches_from_generation
    from nemo_replay.trainer.generation import left_pad

    policy = _policy()
    g = torch.Generator().manual_seed(3)
    prompts = [p for p in SuccessorTask(V, 1, 5, 5).prompts(3, g) for _ in range(2)]  # ragged: left padding differs
    input_ids, attention_mask = left_pad(prompts)
    torch.manual_seed(5)
    out = generate_with_support(
        policy, input_ids, attention_mask,
        GenerationConfig(do_sample=True, top_k=6, top_p=0.9, max_new_tokens=5, pad_token_id=0, eos_token_id=3),
    )
    lengths = [int(c.numel()) for c in out.completions]
    advantages = torch.arange(6, dtype=torch.float32)
    micro = replay_batches_from_generation(out, input_ids, attention_mask, advantages=advantages, micro_batch_size=4)
    assert [b.batch_size for b in micro] == [4, 2]
    assert torch.equal(torch.cat([b.advantages for b in micro]), advantages)
    for b, first in zip(micro, (0, 4)):
        for i in range(b.batch_size):
            real = b.sequences[i][b.attention_mask[i]]
            assert torch.equal(real, torch.cat([prompts[first + i], out.completions[first + i]]))
    assert sum(int(b.loss_mask.sum()) for b in micro) == sum(lengths)
    assert sum(b.support.num_rows for b in micro) == sum(lengths)
    roles = ReplayRoles("fsdp")
    roles.recompute(policy, micro)
    assert roles.last_metrics["mismatch_max"] < 1e-5  # generate's KV-cached float32 vs the trainer's forward
    with pytest.raises(ValueError, match=r"advantages of shape \(5,\); expected \(6,\) or \(6, "):
        replay_batches_from_generation(out, input_ids, attention_mask, advantages=advantages[:5])
    with pytest.raises(ValueError, match=r"input_ids and attention_mask \(B=6, P\) expected"):
        replay_batches_from_generation(out, input_ids[:4], attention_mask[:4])


def test_lightning_example_runs_on_cpu():
    """examples/lightning_replay.py as a user runs it: finishes, finite losses, replay reproduces the sampler."""
    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "examples/lightning_replay.py", "--steps", "3"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["finite"] and summary["replay"] and len(summary["loss"]) == 3
    assert max(summary["mismatch_max"]) < 1e-5
    assert elapsed < 60, f"the example took {elapsed:.0f} s"


def test_a_strategy_that_cannot_take_manual_backward_is_refused_under_ddp():
    """A replay strategy without a settable backward (megatron's runs in its schedule) would skip DDP's all-reduce."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from nemo_replay.strategies.base import ReplayStrategy

    class ScheduleOwned(ReplayStrategy):
        name = "schedule_owned"

        def run_role(self, role, model, batches, settings, *, loss_fn=None):
            return []

    module = TinyRL(_policy())
    ddp = SimpleNamespace(strategy=DDPStrategy(), world_size=2)
    with pytest.raises(ValueError, match="the schedule_owned replay strategy runs the policy backward inside its own "
                                         "schedule, where Lightning's DDPStrategy cannot prepare the gradient all-reduce"):
        ReplayCallback(ScheduleOwned()).setup(ddp, module, "fit")
    ReplayCallback(ScheduleOwned()).setup(SimpleNamespace(strategy=SingleDeviceStrategy("cpu"), world_size=1), module, "fit")
    # The fsdp strategy takes the module's manual_backward, and gets its own back at teardown.
    callback = ReplayCallback("fsdp")
    callback.setup(ddp, module, "fit")
    assert callback.roles.strategy.backward == module.manual_backward
    callback.teardown(ddp, module, "fit")
    assert callback.roles.strategy.backward is None
