"""generation_support through NeMo-RL's own data-path functions, from a vLLM output to replay_prepare_fn.

Run by tests/integrations/nemo_rl/test_source.py in a fresh process whose ``nemo_rl`` is a
patched copy of the tree ``NEMO_RL_SRC`` names (commit 7ea279a). Everything below is NeMo-RL's
code except vLLM itself (not installed: ``llm.generate`` hands back RequestOutputs built field
for field, tests/rollout/engines/engine_outputs.py), the tokenizer's ``batch_decode`` and the logits:

1. ``VllmGenerationWorkerImpl.generate`` (vllm_worker.py:850-1075) with replay's mixin, two
   data-parallel shards of different widths;
2. ``BatchedDataDict.from_batches`` joining them as ``VllmGeneration.generate`` does
   (vllm_generation.py:676-678);
3. ``generate_responses`` (rollouts.py:469-552, patched) slicing each message;
4. ``add_grpo_token_loss_masks_and_generation_logprobs`` and
   ``batched_message_log_to_flat_message`` as ``grpo_train`` calls them (grpo.py:3150-3162),
   ``_build_async_grpo_train_data`` (grpo.py:2130-2146) and the ``logprob_data`` dict of
   grpo.py:3218-3235; all inside a replay run, as the launcher runs them, where a generated
   message whose rows were lost names the rollout code (both ranks returned rows);
5. ``replay_prepare_fn`` with NeMo-RL's ``LossInputType``: the sampler's log-probs back;
6. the launcher's entry points (``run_grpo.NemoRL.load``) resolve in NeMo-RL, and replay's vLLM
   worker is a Ray actor with the options NeMo-RL gives its own.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from types import SimpleNamespace

import torch

from tests.integrations.nemo_rl.pytest_plugins.nemo_rl_cpu_shims import install_cpu_shims


def main() -> None:
    install_cpu_shims()
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.loss.interfaces import LossInputType
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.experience import rollouts
    from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorkerImpl

    from nemo_replay.integrations.nemo_rl import install_data_path, replay_prepare_fn
    from nemo_replay.integrations.nemo_rl.datapath import replay_run
    from nemo_replay.support.rows import SampleRows, batch_rows
    from nemo_replay.integrations.nemo_rl.workers import ReplayVllmMixin, worker_fqn
    from nemo_replay.rollout.engines.vllm import vllm_row_width
    from tests.integrations.nemo_rl.batches import TEMPERATURE, make_logits
    from tests.rollout.engines.engine_outputs import RequestOutput, vllm_offline_output, vllm_steps

    assert rollouts.__file__.startswith(sys.argv[1]), f"nemo_rl came from {rollouts.__file__}, not the patched copy"
    installed = install_data_path()
    assert len(installed.wrapped) == 4, installed
    # The data path runs as the launcher runs it: inside a replay run (run_grpo.main).
    run = contextlib.ExitStack()
    run.enter_context(replay_run(worker=worker_fqn("ReplayVllmGenerationWorker")))

    top_k, vocab, pad = 6, 64, 0
    # The engine allows 2 top_k log-probs: each request asks width + 1 of them, rows are width wide.
    max_logprobs = 2 * top_k
    width = vllm_row_width(top_k, max_logprobs)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (3, 5, 4, 2)]
    gen_lengths = [4, 2, 5, 7]  # the shards' widths differ: 5 + 4 and 4 + 7
    logits = make_logits(4, 16, seed=9, dtype=torch.float32)  # column t - 1 drew token t

    class SamplingParams:  # vllm.SamplingParams keyword fields (vllm/sampling_params.py:271-470)
        def __init__(self, **fields):
            self.__dict__.update(fields)

    class LLM:
        def __init__(self, rows):
            self.rows = rows
            # llm.llm_engine.model_config: max_model_len (vllm_worker.py:1023) and get_vocab_size()
            # (vllm/config/model.py:1629), the two fields the worker and replay read.
            self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: vocab))

        def generate(self, prompts_in, params, use_tqdm=True):
            assert params.logprobs == width + 1, params.__dict__
            out = []
            for i in self.rows:
                p, n = prompts[i], gen_lengths[i]
                steps = vllm_steps(logits[i, len(p) - 1 : len(p) - 1 + n], TEMPERATURE, top_k=top_k, top_p=0.9,
                                   num_logprobs=params.logprobs, seed=i)
                out.append(RequestOutput(str(i), None, p.tolist(), None, [vllm_offline_output(steps, params.logprobs)],
                                         True))
            return out

    cfg = {"top_k": top_k, "top_p": 0.9, "temperature": TEMPERATURE, "max_new_tokens": 8, "stop_token_ids": None,
           "stop_strings": None, "_pad_token_id": pad, "vllm_cfg": {"use_tqdm": False},
           "vllm_kwargs": {"max_logprobs": max_logprobs}}
    worker_cls = type("ReplayWorker", (ReplayVllmMixin, VllmGenerationWorkerImpl), {})

    def shard(rows):
        w = object.__new__(worker_cls)
        w.cfg, w.llm, w.SamplingParams, w.routed_experts_dtype = cfg, LLM(rows), SamplingParams, torch.int16
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.int64)
        for j, i in enumerate(rows):
            ids[j, : len(prompts[i])] = prompts[i]
        data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([len(prompts[i]) for i in rows])})
        return w.generate(data)

    class Generation:  # VllmGeneration.generate's join of its data-parallel workers (vllm_generation.py:676-678)
        def generate(self, data, greedy=False):
            return BatchedDataDict.from_batches([shard([0, 1]), shard([2, 3])], pad_value_dict={"output_ids": pad})

    joined = Generation().generate(None)
    entries = joined["generation_support"]  # one SampleRows a sample; from_batches joined the shards' lists
    assert isinstance(entries, list) and len(entries) == 4 and all(isinstance(e, SampleRows) for e in entries)
    dense = 4 * (4 + 7) * width * 4  # the (B, total_length, width) int32 rows it replaces over Ray
    assert len(pickle.dumps(entries)) < dense, (len(pickle.dumps(entries)), dense)

    batch = BatchedDataDict({"message_log": [[{"role": "user", "content": "", "token_ids": p}] for p in prompts]})
    input_lengths = torch.tensor([len(p) for p in prompts])
    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens=True: ["" for _ in ids], pad_token_id=pad)
    batch, _, _ = rollouts.generate_responses(Generation(), BatchedDataDict({}), batch, tokenizer, input_lengths)
    def decoded(rows, tokens):
        """Each column's decoded row (members ascending, [] where none): through batch_rows and the decode."""
        got, row_ids = batch_rows([rows], tokens[None], torch.tensor([rows.length]), name="rows")
        values = got.decode("cpu", check=True).values
        return [[] if r < 0 else [t for t in values[r].tolist() if t >= 0] for r in row_ids[0].tolist()]

    replies = []
    for i, log in enumerate(batch["message_log"]):
        reply = log[-1]
        # The message holds a window of the sample's compact buffer, not (n, width) int32 rows.
        rows = reply["generation_support"]
        assert isinstance(rows, SampleRows) and rows.length == gen_lengths[i]
        assert [b.tobytes() for b in rows.buffers] == [b.tobytes() for b in entries[i].buffers]  # the worker's, whole
        assert rows.recorded().all()
        replies.append(decoded(rows, reply["token_ids"]))
        assert all(0 < len(r) <= width and t in r for r, t in zip(replies[-1], reply["token_ids"].tolist()))

    lost = [[dict(m) for m in log] for log in batch["message_log"]]
    del lost[2][-1]["generation_support"]
    try:  # both ranks of the last generate call returned rows: the cause named is the rollout code
        grpo.add_grpo_token_loss_masks_and_generation_logprobs(lost)
    except ValueError as exc:
        assert "all returned rows (2 data-parallel ranks), so the rollout code" in str(exc), exc
    else:
        raise AssertionError("a generated message without rows passed a replay run")
    grpo.add_grpo_token_loss_masks_and_generation_logprobs(batch["message_log"])
    flat, lengths = grpo.batched_message_log_to_flat_message(
        batch["message_log"], pad_value_dict={"token_ids": pad}, make_sequence_length_divisible_by=8,
    )
    policy_config = {"precision": "float32"}
    repeated = BatchedDataDict({"loss_multiplier": torch.ones(4)})
    train_data = grpo._build_async_grpo_train_data(flat, lengths, repeated, policy_config)
    logprob_data = BatchedDataDict({  # grpo.py:3218-3225
        "input_ids": train_data["input_ids"], "input_lengths": train_data["input_lengths"],
        "token_mask": flat["token_loss_mask"], "sample_mask": repeated["loss_multiplier"],
    })
    grpo._preserve_router_replay_routed_experts(logprob_data, flat, policy_config)
    W = train_data["input_ids"].shape[1]
    # One compact entry a sample (support/rows.py), response positions only; both policy batches share it.
    entries = train_data["generation_support"]
    assert W == 16 and isinstance(entries, list) and len(entries) == 4
    assert logprob_data["generation_support"] is flat["generation_support"]
    assert all(isinstance(e, SampleRows) and e.length == sum(int(m["token_ids"].shape[0]) for m in log)
               for e, log in zip(entries, batch["message_log"]))
    support, token_rows = batch_rows(entries, train_data["input_ids"], train_data["input_lengths"],
                                     name="data['generation_support']", unit="data row")
    support = support.decode("cpu", check=True)  # compact until the scorer's device decodes them
    for i, log in enumerate(batch["message_log"]):
        start = sum(int(m["token_ids"].shape[0]) for m in log[:-1])
        cols = torch.nonzero(token_rows[i] >= 0).flatten().tolist()
        assert cols == list(range(start, start + gen_lengths[i])), (i, cols)
        for c, want in zip(cols, replies[i]):
            assert [t for t in support.values[int(token_rows[i, c])].tolist() if t >= 0] == want
    dense = 4 * W * width * 4  # what the token-aligned (B, S, k) int32 tensor held
    compact = len(pickle.dumps(entries))
    assert compact < dense, (compact, dense)
    # NeMo-RL's own slicing and reordering carry the entries with their samples.
    part = train_data.slice(1, 3)
    assert part["generation_support"] == entries[1:3]
    back = train_data.slice(0, 4)
    back.reorder_data([3, 2, 1, 0])  # in place
    reordered = [b.tobytes() for e in back["generation_support"] for b in e.buffers]
    assert reordered == [b.tobytes() for e in entries[::-1] for b in e.buffers]

    scaled = logits[:, :W] / TEMPERATURE
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB)
    out, _ = replay_prepare_fn(logits=scaled, data=train_data, loss_fn=loss_fn)
    mask = train_data["token_mask"][:, 1:] != 0
    assert int(mask.sum()) == sum(gen_lengths)
    err = (out["next_token_logprobs"][mask] - train_data["generation_logprobs"][:, 1:][mask]).abs().max()
    assert float(err) < 1e-5, float(err)
    run.close()
    # The launcher's NeMo-RL entry points resolve, and replay's vLLM worker is a Ray actor with NeMo-RL's options.
    from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorker

    from nemo_replay.integrations.nemo_rl import workers
    from nemo_replay.integrations.nemo_rl.run_grpo import NemoRL

    nemo = NemoRL.load()
    assert nemo.grpo is grpo and nemo.rollouts is rollouts
    actor = workers.ReplayVllmGenerationWorker
    assert type(actor).__name__ == "ActorClass(ReplayVllmGenerationWorker)", type(actor)
    assert actor._default_options == VllmGenerationWorker._default_options
    # The same scores from a slice of the batch, as a policy worker's shard holds it.
    part_out, _ = replay_prepare_fn(logits=scaled[1:3], data=part, loss_fn=loss_fn)
    assert torch.equal(part_out["next_token_logprobs"], out["next_token_logprobs"][1:3])
    print(f"ok {float(err):.2e} rows {compact} B pickled, dense {dense} B")


if __name__ == "__main__":
    main()
