"""NeMo-RL switched on end to end, the parts that run without NeMo-RL: data path, workers, patch, launcher.

Objects are built field for field as NeMo-RL builds them at commit 7ea279a (file:line there):

- a generated assistant message: ``{"role": "assistant", "content", "token_ids":
  output_ids[i, input_length:total_length], "generation_logprobs": logprobs[i, ...]}``
  (``nemo_rl/experience/rollouts.py:516-524``); prompt and environment messages carry
  ``role``, ``content``, ``token_ids`` only;
- ``add_grpo_token_loss_masks_and_generation_logprobs`` (``nemo_rl/algorithms/grpo.py:1910-1942``)
  sets ``token_loss_mask`` to ones on generated assistant messages and zeros elsewhere, and
  zero ``generation_logprobs`` where missing;
- the vLLM worker's output: ``output_ids`` / ``logprobs`` ``[B, padded_input_length + max
  generated]``, prompt at ``[0, input_length)``, generated tokens after it
  (``nemo_rl/models/generation/vllm/vllm_worker.py:925-1075``); its sampling params from
  ``_build_sampling_params`` (``vllm_worker.py:641-668``, ``logprobs=0``).

The same data path through NeMo-RL's own functions runs in tests/integrations/nemo_rl/test_source.py
when a NeMo-RL tree is at hand.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from nemo_replay.integrations.nemo_rl import (
    backfill_support,
    carry_support,
    install_data_path,
    next_token_logprobs,
    patch_state,
    with_support_pad,
)
from nemo_replay.integrations.nemo_rl import patch as patch_mod
from nemo_replay.integrations.nemo_rl import workers
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.integrations.nemo_rl.datapath import message_log_rows
from nemo_replay.support.rows import SampleRows, batch_rows
from tests.integrations.nemo_rl.batches import TEMPERATURE, make_logits
from tests.rollout.engines.engine_outputs import RequestOutput, SamplingMask, vllm_offline_output, vllm_steps

K = 5
VOCAB = 64


def _csr(rows: torch.Tensor) -> RaggedSupport:
    """A message's dense rows (n, width), -1 padded, as the CSR rows the worker reads off vLLM."""
    return RaggedSupport.from_padded(PackedTensor(rows.to(torch.int32), [0, rows.shape[0]]))


def _encoded(rows: torch.Tensor, tokens: torch.Tensor) -> SampleRows:
    """A generated message's rows as the rollout code slices them out of a worker's SampleRows whose
    generated tokens start at column 0 (what ``SampleRows.encode`` gives for the message alone)."""
    return SampleRows.encode(_csr(rows), tokens)


def _message(role, ids, rows=None, generated=False, encode=_encoded):
    m = {"role": role, "content": "", "token_ids": torch.tensor(ids, dtype=torch.int64)}
    if generated:
        m["generation_logprobs"] = -torch.rand(len(ids))
    if rows is not None:
        m["generation_support"] = encode(torch.tensor(rows, dtype=torch.int32), m["token_ids"])
    return m


def _decoded(sample: SampleRows, tokens: torch.Tensor) -> list:
    """Each column's decoded row (its members, ascending; [] where none), through batch_rows and the decode."""
    rows, row_ids = batch_rows([sample], tokens[None], torch.tensor([sample.length]), name="rows")
    values = rows.decode("cpu", check=True).values
    return [[] if r < 0 else [t for t in values[int(r)].tolist() if t >= 0] for r in row_ids[0].tolist()]


def _nemo_rl_masks(message_logs):
    """grpo.py:1910-1942, the loss mask and the missing generation_logprobs (what replay runs after)."""
    for log in message_logs:
        for m in log:
            generated = m["role"] == "assistant" and "generation_logprobs" in m
            m["token_loss_mask"] = (torch.ones_like if generated else torch.zeros_like)(m["token_ids"])
            m.setdefault("generation_logprobs", torch.zeros_like(m["token_ids"], dtype=torch.float32))


def _multi_turn_logs(encode=_encoded):
    """Trajectory 0: prompt, generated turn (k=5, its second token flagged), tool output, generated
    turn from the mask path (rows 3 wide). Trajectory 1: prompt with a history assistant turn, one turn.
    ``encode(rows (n, k) -1 padded, token_ids (n,))`` gives a generated message's SampleRows."""
    t0 = [
        _message("user", [11, 12, 13]),
        _message("assistant", [21, 22, 23], [[21, 1, 2, 3, 4], [-1] * 5, [23, 5, -1, -1, -1]], generated=True,
                 encode=encode),
        _message("user", [31, 32]),
        _message("assistant", [41, 42], [[41, 7, 8], [42, -1, -1]], generated=True, encode=encode),
    ]
    t1 = [
        _message("user", [51]),
        _message("assistant", [52, 53]),  # a prompt's own assistant turn: not generated, no rows
        _message("assistant", [61], [[61, 9, 10, 11, 12]], generated=True, encode=encode),
    ]
    return [t0, t1]


def test_message_windows_of_the_worker_s_compact_rows_read_as_the_message_s_own_rows():
    """What the patched rollout code puts in a message, ``rows[i][input_length:total_length]`` of the
    worker's SampleRows (a window of one compact buffer, the worker's left pad and right padding
    columns included), gives the same flagged tokens and the same compact entry as the message's
    rows encoded on their own."""
    def window(rows, tokens):
        n = rows.shape[0]
        # The worker's layout: 4 prompt columns, then the generated tokens' rows, then padding.
        generated = SampleRows.encode(_csr(rows), tokens, start=4)
        wide = generated[2:4 + n + 3]  # a wider window: no rows outside the generated tokens
        recorded = (rows >= 0).any(-1)
        assert wide.length == n + 5 and wide.recorded().tolist() == [False] * 2 + recorded.tolist() + [False] * 3
        as_sets = [sorted(v for v in r if v >= 0) for r in rows.tolist()]  # rows decode sorted
        padded = torch.cat([tokens.new_zeros(2), tokens, tokens.new_zeros(3)])
        assert _decoded(wide, padded) == [[]] * 2 + as_sets + [[]] * 3
        return generated[4:4 + n]

    own, windows = _multi_turn_logs(), _multi_turn_logs(encode=window)
    _nemo_rl_masks(own), _nemo_rl_masks(windows)
    assert backfill_support(own) == backfill_support(windows) == 1
    assert all(torch.equal(a["token_loss_mask"], b["token_loss_mask"]) for x, y in zip(own, windows) for a, b in zip(x, y))
    for a, b in zip(message_log_rows(own, "generation_support"), message_log_rows(windows, "generation_support")):
        assert np.array_equal(a.runs, b.runs) and a.length == b.length
        assert [x.tobytes() for x in a.buffers] == [x.tobytes() for x in b.buffers]
    short = _multi_turn_logs()
    rows = torch.tensor([[21, 1, 2, 3, 4], [-1] * 5, [23, 5, -1, -1, -1]], dtype=torch.int32)
    short[0][1]["generation_support"] = SampleRows.encode(_csr(rows), short[0][1]["token_ids"])[0:2]
    _nemo_rl_masks(short)
    with pytest.raises(ValueError, match=r"trajectory 0, message 1: generation_support must be the rows of its 3 tokens "
                                         r"\(SampleRows, one column a token_ids entry\), got SampleRows of 2 columns; "
                                         r"slice the vLLM worker's rows as generation_logprobs is sliced"):
        backfill_support(short)
    # The retired dense (n, k) rows in a message: refused by name, with the fix, by both readers.
    dense = _multi_turn_logs()
    dense[0][3]["generation_support"] = torch.tensor([[41, 7, 8], [42, -1, -1]], dtype=torch.int32)
    _nemo_rl_masks(dense)
    match = (r"trajectory 0, message 3: generation_support must be the rows of its 2 tokens \(SampleRows, one column a "
             r"token_ids entry\), got Tensor; slice the vLLM worker's rows as generation_logprobs is sliced")
    with pytest.raises(ValueError, match=match):
        backfill_support(dense)
    with pytest.raises(ValueError, match=match):
        message_log_rows(dense, "generation_support")


def test_flagged_tokens_leave_the_loss_and_each_sample_keeps_its_response_rows_only():
    logs = _multi_turn_logs()
    _nemo_rl_masks(logs)
    assert backfill_support(logs) == 1
    t0, t1 = logs
    assert t0[1]["token_loss_mask"].tolist() == [1, 0, 1]  # the flagged token left the loss
    assert t1[2]["token_loss_mask"].tolist() == [1] and t1[1]["token_loss_mask"].sum() == 0
    assert "generation_support" not in t0[0] and "generation_support" not in t1[1]  # no prompt-position rows
    # One compact entry a sample: the recorded rows at their columns in the flattened log
    # (llm_message_utils.py:118-135 concatenates the messages in order).
    entries = message_log_rows(logs, "generation_support")
    assert entries[0].columns().tolist() == [3, 5, 8, 9] and entries[1].columns().tolist() == [3]
    assert [e.length for e in entries] == [10, 4]
    assert entries[0].recorded().tolist() == [False] * 3 + [True, False, True] + [False] * 2 + [True, True]
    ids = torch.zeros(2, 10, dtype=torch.int64)
    for i, log in enumerate(logs):
        flat = torch.cat([m["token_ids"] for m in log])
        ids[i, : flat.numel()] = flat
    support, token_rows = batch_rows(entries, ids, torch.tensor([10, 4]), name="data['generation_support']",
                                     unit="data row")
    support = support.decode("cpu", check=True)  # compact until the scorer's device decodes them
    row = lambda r: [t for t in support.values[int(r)].tolist() if t >= 0]  # noqa: E731
    assert [row(r) for r in token_rows[0][token_rows[0] >= 0]] == [[1, 2, 3, 4, 21], [5, 23], [7, 8, 41], [42]]
    assert row(token_rows[1, 3]) == [9, 10, 11, 12, 61]
    # Rows of another sample with the same columns fail the membership check, never rebuilt around the wrong tokens.
    same = [SampleRows.encode(_csr(torch.tensor([[-1], [t]])), torch.tensor([7, t])) for t in (11, 12)]
    swapped = {"input_ids": torch.tensor([[7, 11], [7, 12]]), "input_lengths": torch.tensor([2, 2]),
               "token_mask": torch.tensor([[0, 1], [0, 1]]), "sample_mask": torch.ones(2),
               "generation_support": same[::-1]}
    with pytest.raises(SupportAlignmentError, match=r"trajectory 0, token position 1: token 11 is not a member of its "
                                                    r"support row \[12\]"):
        next_token_logprobs(torch.randn(2, 2, 16), swapped)
    # Rows of another sample, or reordered apart from input_ids, are named.
    with pytest.raises(ValueError, match=r"data\['generation_support'\]\[1\] \(data row 1\): row columns from 3 to 3 "
                                         r"in 1 runs must increase and lie below the sample's 3 token columns \(3 tokens, "
                                         r"a batch of 10 columns\): the rows belong to another sample"):
        batch_rows(entries, ids, torch.tensor([10, 3]), name="data['generation_support']", unit="data row")


@pytest.mark.parametrize("lengths", [[3, 3], [3, 2], [2, 2**40], [0, 2], [2, -1]])
def test_input_lengths_past_the_width_are_named_before_the_rows_are_placed(lengths):
    """batch_rows placed the compact rows by input_lengths before the width check: a length past
    input_ids' width, with rows recorded past it, was a raw IndexError. The width check now runs
    first, whatever the rows key holds."""
    # Three tokens recorded a sample; input_ids cut to two columns.
    entries = [SampleRows.encode(_csr(torch.tensor([[-1], [t], [5]])), torch.tensor([7, t, 5])) for t in (11, 12)]
    data = {"input_ids": torch.tensor([[7, 11], [7, 12]]), "input_lengths": torch.tensor(lengths),
            "token_mask": torch.tensor([[0, 1], [0, 1]]), "sample_mask": torch.ones(2), "generation_support": entries}
    row = next(i for i, n in enumerate(lengths) if not 1 <= n <= 2)
    match = rf"data\['input_lengths'\]: data row {row} has input_lengths {lengths[row]}, outside \[1, 2\] \(the width of input_ids\)"
    with pytest.raises(ValueError, match=match):
        next_token_logprobs(torch.randn(2, 2, 16), data)
    data["generation_support"] = torch.tensor([[[-1], [11]], [[-1], [12]]], dtype=torch.int32)  # not even rows
    with pytest.raises(ValueError, match=match):
        next_token_logprobs(torch.randn(2, 2, 16), data)


def test_backfill_refuses_a_generated_message_without_rows_or_with_misshaped_rows():
    logs = _multi_turn_logs()
    del logs[1][2]["generation_support"]
    _nemo_rl_masks(logs)
    with pytest.raises(ValueError, match=r"trajectory 1, message 2 \('assistant', 1 tokens\) was generated but carries no "
                                         r"generation_support.*patch apply NEMO_RL_DIR"):
        backfill_support(logs)
    logs = _multi_turn_logs()
    logs[0][3]["generation_support"] = logs[0][3]["generation_support"][:1]
    _nemo_rl_masks(logs)
    with pytest.raises(ValueError, match=r"trajectory 0, message 3: generation_support must be the rows of its 2 tokens "
                                         r"\(SampleRows, one column a token_ids entry\), got SampleRows of 1 columns; "
                                         r"slice the vLLM worker's rows as generation_logprobs is sliced "
                                         r"\(\[i\]\[input_length:total_length\]\)"):
        backfill_support(logs)


def test_rows_and_tokens_that_would_shrink_or_be_cut_are_refused_where_they_are_encoded():
    """Dense rows once read every entry >= 0 as a member wherever it sat: ``[5, -25536, -1]`` (token
    40000 wrapped by int16) became {5} (and a row of only such entries a flagged token, silently out
    of the loss), ``[5, -1, 1]`` became {1, 5}; ids past int32 wrapped and float tokens were cut. The
    rows are encoded once, where they are recorded (the vLLM worker's ``SampleRows.encode``), and held
    there to docs/design.md §2: -1 only as a trailing pad, integer ids, each recorded row holding its
    token; the error names the request and the row."""
    where = "W.generate, request 0"
    bad = [
        (torch.tensor([[21, 1, -1], [5, -25536, -1]], dtype=torch.int16),
         rf"{where}: row 1 holds an id below -1 .*\[5, -25536, -1\]"),
        (torch.tensor([[21, 1, -1], [-25536, -1, -1]], dtype=torch.int16), rf"{where}: row 1 holds an id below -1"),
        (torch.tensor([[21, 1, -1], [5, -1, 1]]), rf"{where}: row 1 has a member after -1 padding .*\[5, -1, 1\]"),
        (torch.tensor([[21, 1, -1], [5, 2**32 + 3, -1]]), rf"{where}: row 1 holds an id >= vocab_size=2147483647"),
    ]
    for rows, match in bad:
        with pytest.raises(ValueError, match=match):
            SampleRows.encode(PackedTensor(rows, [0, 2]), torch.tensor([21, 5]), start=2, where=where)
    rows = PackedTensor(torch.tensor([[21, 1], [5, -1]]), [0, 2])
    with pytest.raises(ValueError, match=rf"{where}: sampled_ids of dtype torch.float32; expected integer token ids"):
        SampleRows.encode(rows, torch.tensor([21.0, 5.0]), where=where)
    with pytest.raises(ValueError, match=rf"{where}: 2 support rows for 3 sampled tokens; one row a token"):
        SampleRows.encode(rows, torch.tensor([21, 5, 7]), where=where)
    # A recorded row without its token, named by its row among the rows given (the generated token),
    # also past a row that could not be recorded.
    with pytest.raises(SupportAlignmentError, match=rf"{where}: .*row 1: sampled token 6 is not a member of its "
                                                    rf"support row \[5\]"):
        SampleRows.encode(rows, torch.tensor([21, 6]), where=where)
    flagged_first = PackedTensor(torch.tensor([[-1, -1], [21, 1], [5, -1]]), [0, 3])
    with pytest.raises(SupportAlignmentError, match=rf"{where}: .*row 2: sampled token 6 is not a member of its "
                                                    rf"support row \[5\]"):
        SampleRows.encode(flagged_first, torch.tensor([7, 21, 6]), start=4, where=where)


def test_batch_rows_checks_runs_and_their_dtype_before_it_makes_a_column():
    """Run counts sized the columns before anything checked them: a run of 2**31 - 1 columns over a buffer
    of one row asked for 16 GiB, and float runs were cut to integers. A run must fit the rows its buffer
    holds (held to the buffer's bytes) and the sample's columns before a column is made, and runs must be
    integers."""
    import tracemalloc

    entry = SampleRows.encode(_csr(torch.tensor([[3, 9], [4, -1]])), torch.tensor([3, 4]))
    ids, lengths = torch.tensor([[3, 4]]), torch.tensor([2])
    kw = dict(name="data['k']", unit="data row")
    batch_rows([entry], ids, lengths, **kw)  # the entry as written
    for count in (10**7, 2**31 - 1):
        runs = np.array([[0, 0, count]], np.int64)
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match=r"data\['k'\]\[0\] \(data row 0\): "):
                batch_rows([SampleRows(entry.buffers, runs, count)], ids, lengths, **kw)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak  # no column made: 10**7 of them took 80 MB
    # Runs naming more rows than the buffer holds, inside the sample's columns.
    wide_ids, wide_lengths = torch.tensor([[3, 4, 5]]), torch.tensor([3])
    with pytest.raises(ValueError, match=r"data\['k'\]\[0\] \(data row 0\): runs name rows up to 2 of buffers "
                                         r"holding 2; a corrupted entry"):
        batch_rows([SampleRows(entry.buffers, np.array([[0, 0, 3]], np.int32), 3)], wide_ids, wide_lengths, **kw)
    for runs in (entry.runs.astype(np.float64), np.array([[0.0, 0.0, 2.5]]), entry.runs.astype(np.float32) + 0.25):
        with pytest.raises(ValueError, match=rf"data\['k'\]\[0\] \(data row 0\): runs of dtype {runs.dtype}, shape "
                                             rf".*; expected \(n, 3\) integer"):
            batch_rows([SampleRows(entry.buffers, runs, 2)], ids, lengths, **kw)


def test_pads_and_carrying_into_the_policy_batches():
    given = {"token_ids": 0}
    assert with_support_pad(given) == {"token_ids": 0, "generation_support": -1} and given == {"token_ids": 0}
    assert with_support_pad(None) == {"generation_support": -1}
    with pytest.raises(ValueError, match=r"pad_value_dict\['generation_support'\]=0: support rows are padded with -1"):
        with_support_pad({"generation_support": 0})
    ids = torch.zeros(2, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"flattened rollout batch has no 'generation_support'"):
        carry_support({"input_ids": ids}, {"token_ids": ids})
    # One SampleRows a sample, nothing else: the retired dense (B, S, k) rows are refused by name.
    entries = [SampleRows.encode(_csr(torch.tensor([[3, 9], [4, -1]])), torch.tensor([3, 4]), length=6) for _ in range(2)]
    train = {"input_ids": ids}
    carry_support(train, {"generation_support": entries})
    assert train["generation_support"] is entries
    refused = ((torch.full((2, 6, K), -1), "Tensor"), (torch.full((2, 5, K), -1), "Tensor"), (entries[:1], "1 entries"))
    for given, got in refused:
        with pytest.raises(ValueError, match=rf"flattened generation_support holds {got} for 2 samples; expected a list "
                                             rf"of one SampleRows a sample \(what the flattening wrapper writes\)"):
            carry_support({"input_ids": ids}, {"generation_support": given})


# ------------------------------------------------------------------------------ install_data_path


def _module(tmp_path: Path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stand_ins(tmp_path, patched=True):
    """Modules with NeMo-RL's names and signatures (batched_data_dict.py:190-197, llm_message_utils.py:257-261,
    grpo.py:1910 and 2115-2122, rollouts.py:469); each records what it was called with."""
    bdd = _module(tmp_path, "bdd_standin", """
        calls = []
        class BatchedDataDict(dict):
            @classmethod
            def from_batches(cls, batches, pad_value_dict=None, *, allow_missing_packed_tensors=False):
                calls.append(pad_value_dict)
                return cls()
    """)
    grpo = _module(tmp_path, "grpo_standin", """
        calls = []
        def batched_message_log_to_flat_message(message_log_batch, pad_value_dict=None, make_sequence_length_divisible_by=1):
            calls.append(pad_value_dict)
            return message_log_batch, None
        def add_grpo_token_loss_masks_and_generation_logprobs(message_logs):
            for log in message_logs:
                for m in log:
                    generated = m["role"] == "assistant" and "generation_logprobs" in m
                    m["token_loss_mask"] = m["token_ids"] * 0 + int(generated)
        def _preserve_router_replay_routed_experts(target, flat_messages, policy_config):
            calls.append("routes")
    """)
    slicing = '        if "generation_support" in generation_outputs:\n            pass\n' if patched else ""
    rollouts = _module(tmp_path, "rollouts_standin" + ("" if patched else "_unpatched"),
                       "def generate_responses(generation_outputs):\n    if True:\n" + slicing + "        return None\n")
    return grpo, bdd, rollouts


def test_install_data_path_wraps_each_boundary_once_and_refuses_an_unpatched_tree(tmp_path):
    grpo, bdd, rollouts = _stand_ins(tmp_path)
    done = install_data_path(grpo=grpo, batched_data_dict=bdd, rollouts=rollouts)
    assert done.wrapped == ["BatchedDataDict.from_batches", "grpo.batched_message_log_to_flat_message",
                            "grpo.add_grpo_token_loss_masks_and_generation_logprobs",
                            "grpo._preserve_router_replay_routed_experts"]
    assert install_data_path(grpo=grpo, batched_data_dict=bdd, rollouts=rollouts).wrapped == []
    bdd.BatchedDataDict.from_batches([{}], pad_value_dict={"output_ids": 7})
    assert bdd.calls == [{"output_ids": 7, "generation_support": -1}]
    grpo.batched_message_log_to_flat_message([], pad_value_dict={"token_ids": 0})
    logs = _multi_turn_logs()
    grpo.add_grpo_token_loss_masks_and_generation_logprobs(logs)
    assert logs[0][1]["token_loss_mask"].tolist() == [1, 0, 1] and "generation_support" not in logs[0][0]
    target = {"input_ids": torch.zeros(1, 3)}
    grpo._preserve_router_replay_routed_experts(target, {"generation_support": [SampleRows.none(3)]}, {})
    assert grpo.calls == [{"token_ids": 0, "generation_support": -1}, "routes"] and "generation_support" in target
    (tmp_path / "u").mkdir()
    _, _, unpatched = _stand_ins(tmp_path / "u", patched=False)
    with pytest.raises(ValueError, match=r"does not slice generation_support into the assistant messages.*"
                                         r"python -m nemo_replay.integrations.nemo_rl.patch apply"):
        install_data_path(grpo=grpo, batched_data_dict=bdd, rollouts=unpatched)


# ------------------------------------------------------------------------------ the patch command


def test_the_patch_refuses_a_tree_at_another_commit_by_name(tmp_path):
    text = patch_mod.PATCH_FILE.read_text()
    assert "+++ b/nemo_rl/experience/rollouts.py" in text and "+++ b/nemo_rl/experience/rollout_manager.py" in text
    assert sum(line.startswith("+") and not line.startswith("+++") for line in text.splitlines()) == 12
    with pytest.raises(ValueError, match=r"is not a NeMo-RL source tree \(no nemo_rl/__init__.py\)"):
        patch_state(tmp_path)
    tree = tmp_path / "RL"
    (tree / "nemo_rl" / "experience").mkdir(parents=True)
    (tree / "nemo_rl" / "__init__.py").write_text("")
    (tree / "nemo_rl" / "experience" / "rollouts.py").write_text("# another commit's file\n")
    with pytest.raises(ValueError, match=r"nemo_rl/experience/rollouts.py differs from that commit's: the replay patch is "
                                         r"written for that file as NeMo-RL 7ea279a has it"):
        patch_state(tree)
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    done = subprocess.run([sys.executable, "-W", "error", "-m", "nemo_replay.integrations.nemo_rl.patch", "apply", str(tree)],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stdout
    # One `error:` line, no traceback, no warning: the file that differs, the commit, the fix.
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr and "Warning" not in done.stderr
    assert f"rollouts.py differs from that commit's (the tree is at commit {head[:12]})" in done.stderr
    assert "git -C" in done.stderr and "checkout 7ea279a -- nemo_rl/experience/rollouts.py" in done.stderr


def test_a_branch_on_top_of_the_pinned_commit_is_patched_by_content(tmp_path):
    """A user's own commits on top of 7ea279a were refused by commit id, although the patched
    files were the pinned ones. The check is the files' content: such a branch patches."""
    import os

    src = Path(os.environ.get("NEMO_RL_SRC") or Path(__file__).resolve().parents[4] / "shared" / "nemo-rl-7ea279a")
    if not (src / "nemo_rl").is_dir():
        pytest.skip(f"needs NeMo-RL's tree at 7ea279a: set NEMO_RL_SRC (looked in {src})")
    tree = tmp_path / "RL"
    (tree / "nemo_rl" / "experience").mkdir(parents=True)
    (tree / "nemo_rl" / "__init__.py").write_text("")
    for name in patch_mod.PATCHED_FILES:
        (tree / name).write_bytes((src / name).read_bytes())
    (tree / "my_change.py").write_text("# the user's own commit\n")
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "a branch on top of 7ea279a"], check=True)
    assert patch_state(tree) == "pinned"
    done = subprocess.run([sys.executable, "-W", "error", "-m", "nemo_replay.integrations.nemo_rl.patch", "apply", str(tree)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert patch_state(tree) == "patched"


# ------------------------------------------------------------------------------ workers


class _SamplingParams:
    """The fields NeMo-RL's _build_sampling_params sets (vllm_worker.py:656-668)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class _NemoRLVllmWorker:
    """NeMo-RL's VllmGenerationWorkerImpl as far as replay touches it: ``_build_sampling_params``
    (vllm_worker.py:641-668) and ``generate``'s layout of output_ids / logprobs (925-1075)."""

    def __init__(self, cfg, llm):
        self.cfg, self.llm = cfg, llm

    def _build_sampling_params(self, *, greedy, stop_strings, max_new_tokens=None):
        return _SamplingParams(temperature=0.0 if greedy else self.cfg["temperature"], top_p=self.cfg["top_p"],
                               top_k=1 if greedy else self.cfg["top_k"], max_tokens=max_new_tokens, logprobs=0)

    def generate(self, data, greedy=False):
        ids, lengths = data["input_ids"], data["input_lengths"]
        params = self._build_sampling_params(greedy=greedy, stop_strings=None)
        outputs = self.llm.generate([ids[i, : lengths[i]].tolist() for i in range(len(ids))], params, use_tqdm=False)
        longest = max(len(o.outputs[0].token_ids) for o in outputs)
        total = ids.shape[1] + longest
        out_ids, logprobs = torch.zeros(len(ids), total, dtype=ids.dtype), torch.zeros(len(ids), total)
        for i, o in enumerate(outputs):
            gen, n = o.outputs[0], int(lengths[i])
            out_ids[i, :n] = ids[i, :n]
            out_ids[i, n : n + len(gen.token_ids)] = torch.tensor(gen.token_ids)
            for j, (tok, lp) in enumerate(zip(gen.token_ids, gen.logprobs)):
                logprobs[i, n + j] = lp[tok].logprob
        return {"output_ids": out_ids, "logprobs": logprobs}


class _LLM:
    """``vllm.LLM.generate(prompts, sampling_params, *, use_tqdm=...) -> list[RequestOutput]``
    (vllm/entrypoints/llm.py:417-427, vLLM 0.33.0), returning prepared RequestOutputs."""

    def __init__(self, outputs):
        self.outputs, self.params = outputs, []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.params.append(sampling_params)
        return self.outputs


def _engine_batch(top_k):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (3, 5)]
    gen = [4, 2]
    logits = make_logits(2, 5 + max(gen), seed=9, dtype=torch.float32)
    outputs = []
    for i, (p, n) in enumerate(zip(prompts, gen)):
        steps = vllm_steps(logits[i, len(p) - 1 : len(p) - 1 + n], TEMPERATURE, top_k=top_k, top_p=0.9,
                           num_logprobs=top_k + 1, seed=i)
        outputs.append(RequestOutput(str(i), None, p.tolist(), None, [vllm_offline_output(steps, top_k + 1)], True))
    ids = torch.zeros(2, 5, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return {"input_ids": ids, "input_lengths": torch.tensor([3, 5])}, outputs, logits


def test_the_vllm_worker_asks_for_the_support_and_returns_rows_that_reproduce_the_engine():
    top_k = 6
    data, outputs, logits = _engine_batch(top_k)
    worker_cls = type("W", (workers.ReplayVllmMixin, _NemoRLVllmWorker), {})
    llm = _LLM(outputs)
    # The engine allows 2 top_k log-probs: rows as wide as 2 top_k - 1 (ties past top_k) are read whole.
    cfg = {"temperature": TEMPERATURE, "top_p": 0.9, "top_k": top_k, "vllm_kwargs": {"max_logprobs": 2 * top_k}}
    worker = worker_cls(cfg, llm)
    result = worker.generate(data)
    assert llm.params[-1].logprobs == 2 * top_k and "generate" not in vars(llm)  # the recorder is gone again
    entries = result["generation_support"]  # one compact entry a sample crosses Ray, encoded once (SampleRows)
    assert isinstance(entries, list) and all(isinstance(e, SampleRows) for e in entries)
    # Sliced by column as the patched rollout code slices it: a window of the same compact buffer.
    windows = [e[0:9] for e in entries]
    assert all(isinstance(w, SampleRows) and w.length == 9 and w.buffers[0] is e.buffers[0]
               for w, e in zip(windows, entries))
    recorded = torch.stack([w.recorded() for w in windows])
    assert recorded.tolist() == [[False] * 3 + [True] * 4 + [False] * 2, [False] * 5 + [True] * 2 + [False] * 2]
    decoded = [_decoded(w, result["output_ids"][i]) for i, w in enumerate(windows)]
    assert all(bool(r) == bool(m) for d, row in zip(decoded, recorded) for r, m in zip(d, row.tolist()))
    # Rows as wide as 2 top_k - 1 (ties past top_k) are read whole, each holding its token.
    assert all(len(r) <= 2 * top_k - 1 for d in decoded for r in d)
    assert all(int(result["output_ids"][i, c]) in r for i, d in enumerate(decoded) for c, r in enumerate(d) if r)
    token_mask = recorded.float()
    batch = {"input_ids": result["output_ids"], "input_lengths": torch.tensor([7, 7]), "token_mask": token_mask,
             "sample_mask": torch.ones(2), "generation_support": windows}
    scores = next_token_logprobs(logits / TEMPERATURE, batch)
    active = token_mask[:, 1:] != 0
    torch.testing.assert_close(scores.logprobs[active], result["logprobs"][:, 1:][active], atol=1e-5, rtol=0)
    greedy = worker.generate(data, greedy=True)
    assert "generation_support" not in greedy and llm.params[-1].logprobs == 0
    with pytest.raises(ValueError, match=r"policy.generation.top_k set to an int > 1"):
        worker_cls({"temperature": 1.0, "top_p": 1.0, "top_k": None}, llm).generate(data)


def test_policy_workers_install_replays_post_processors_in_their_process(monkeypatch):
    from nemo_replay.integrations.nemo_rl import hooks

    for name, (module_name, impl, _actor) in workers.WORKERS.items():
        if name == "ReplayVllmGenerationWorker":
            continue
        module = types.ModuleType(module_name)
        module.LossPostProcessor = module.LogprobsPostProcessor = object
        monkeypatch.setitem(sys.modules, module_name, module)
        seen = []
        base = type(impl, (), {"__init__": lambda self, *a, **k: seen.append((module.LossPostProcessor, a, k))})
        cls = type(name, (workers.ReplayPolicyMixin, base), {"nemo_rl_worker_module": module_name})
        cls("config", tokenizer="tok")
        assert seen[0][1:] == (("config",), {"tokenizer": "tok"})
        assert seen[0][0] in (hooks.ReplayLossPostProcessor, hooks.ReplayAutomodelLossPostProcessor)
        assert module.LogprobsPostProcessor in (hooks.ReplayLogprobsPostProcessor, hooks.ReplayAutomodelLogprobsPostProcessor)
        assert workers.worker_fqn(name) == f"nemo_replay.integrations.nemo_rl.workers.{name}"
    with pytest.raises(ValueError, match=r"nemo_rl_worker_module='': expected one of"):
        type("Bare", (workers.ReplayPolicyMixin,), {})()
    with pytest.raises(AttributeError):
        workers.NoSuchWorker  # noqa: B018


# ------------------------------------------------------------------------------ the launcher


class _Master:
    """grpo.MasterConfig: the recipe's sections as attributes (run_grpo.py reads config.policy, .logger, .data, .env)."""

    def __init__(self, **sections):
        self.__dict__.update(sections)


def _nemo_rl_stand_in(tmp_path, recipe: dict, calls: list):
    """NeMo-RL's entry points as run_grpo.py calls them (examples/run_grpo.py:70-270), each recording its call."""
    from nemo_replay.integrations.nemo_rl.run_grpo import NemoRL

    grpo, bdd, rollouts = _stand_ins(tmp_path)

    def record(name, result=None):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result
        return call

    class Checkpointer:
        def __enter__(self):
            calls.append(("checkpointer.enter", (), {}))

        def __exit__(self, *exc):
            calls.append(("checkpointer.exit", (), {}))

    generation = types.SimpleNamespace(shutdown=record("generation.shutdown"))
    setup_out = ("policy", generation, None, None, "dataloader", None, "loss_fn", "logger", Checkpointer(), "state",
                 "master", {}, {})
    grpo.setup = record("setup", setup_out)
    grpo.grpo_train = record("grpo_train")
    grpo.shutdown_environments = record("shutdown_environments")
    vllm_generation = types.SimpleNamespace(resolve_generation_worker_cls=lambda default_cls, config: default_cls)
    registry = {workers.nemo_rl_fqn(name): f"uv run --locked --extra {name}" for name in workers.WORKERS}
    return NemoRL(
        register_omegaconf_resolvers=record("register_omegaconf_resolvers"),
        load_config=record("load_config", lambda path: OmegaConf.create(recipe)),
        parse_hydra_overrides=record("parse_hydra_overrides", lambda cfg, overrides: OmegaConf.merge(
            cfg, OmegaConf.from_dotlist(overrides))),
        to_container=lambda cfg: OmegaConf.to_container(cfg, resolve=True),
        MasterConfig=_Master,
        get_next_experiment_dir=record("get_next_experiment_dir", lambda d: str(tmp_path / "logs" / "exp_001")),
        init_ray=record("init_ray"),
        get_tokenizer=record("get_tokenizer", "tokenizer"),
        configure_generation_config=record("configure_generation_config", lambda cfg, tok, **kw: cfg),
        setup_response_data=record("setup_response_data", ("data", None, {}, {})),
        Policy=record("Policy", lambda *a, **k: types.SimpleNamespace(train=lambda: {"all_mb_metrics": {  # two ranks
            "replay/mismatch_mean:sum": [0.5, 1.5], "replay/mismatch_mean:count": [10.0, 30.0],
            "replay/mismatch_max": [0.2, 0.7], "loss": [1.0, 2.0]}})),
        grpo=grpo,
        batched_data_dict=bdd,
        rollouts=rollouts,
        vllm_generation=vllm_generation,
        actor_registry=registry,
        create_local_venv_on_each_node=record("create_local_venv_on_each_node",
                                              lambda py_executable, venv_name: f"/venvs/{venv_name}/bin/python"),
    )


@pytest.mark.parametrize("overlay, policy_worker", [
    ("grpo_math_1B_replay.yaml", "ReplayDTensorPolicyWorkerV2"),
    ("grpo_math_1B_megatron_replay.yaml", "ReplayMegatronPolicyWorker"),
])
def test_the_launcher_wires_replay_then_runs_nemo_rls_setup_and_grpo_train(tmp_path, monkeypatch, overlay, policy_worker):
    from nemo_replay.integrations.nemo_rl import run_grpo
    from tests.integrations.nemo_rl.test_recipe import replay_recipe

    recipe = replay_recipe(overlay)
    recipe.update(logger={"log_dir": "logs"}, data={}, env={})
    recipe["policy"].update(tokenizer={"name": "t"}, draft={"enabled": False})
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    calls = []
    nemo = _nemo_rl_stand_in(tmp_path, recipe, calls)
    assert run_grpo.main(["--config", "examples/configs/x.yaml", "policy.generation.top_k=32"], nemo=nemo) == 0
    names = [c[0] for c in calls]
    assert names == ["register_omegaconf_resolvers", "load_config", "parse_hydra_overrides", "get_next_experiment_dir",
                     "init_ray", "create_local_venv_on_each_node", "create_local_venv_on_each_node", "get_tokenizer",
                     "configure_generation_config", "setup_response_data", "setup", "checkpointer.enter", "grpo_train",
                     "checkpointer.exit", "shutdown_environments", "generation.shutdown"]
    setup = calls[names.index("setup")]
    assert setup[1][0].policy["generation"]["top_k"] == 32  # the override reached NeMo-RL's setup
    factory = setup[2]["policy_factory"]
    policy = factory(cluster="c")
    assert calls[-1] == ("Policy", (), {"cluster": "c", "worker_extension_cls_fqn": workers.worker_fqn(policy_worker)})
    # Its train() hands grpo.py the replay metrics combined over micro-batches and ranks (metrics.py).
    assert policy.train()["all_mb_metrics"] == {"replay/mismatch_mean": [2.0 / 40.0], "replay/mismatch_max": [0.7],
                                                "loss": [1.0, 2.0]}
    # The driver's data path is wrapped, NeMo-RL's vLLM worker resolves to replay's, workers find the package.
    assert nemo.grpo.add_grpo_token_loss_masks_and_generation_logprobs.__nemo_replay_wraps__ is not None
    vllm = workers.nemo_rl_fqn("ReplayVllmGenerationWorker")
    assert nemo.vllm_generation.resolve_generation_worker_cls(vllm, {}) == workers.worker_fqn("ReplayVllmGenerationWorker")
    entry = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])
    assert os.environ["PYTHONPATH"].endswith("/somewhere") and (entry / "nemo_replay" / "scoring").is_dir()
    for name in ("ReplayVllmGenerationWorker", policy_worker):  # in the very environment of the class they extend
        assert nemo.actor_registry[workers.worker_fqn(name)] == f"/venvs/{workers.nemo_rl_fqn(name)}/bin/python"


def test_the_launcher_stops_before_any_cluster_on_a_recipe_replay_cannot_run(tmp_path, capsys):
    from nemo_replay.integrations.nemo_rl import run_grpo
    from tests.integrations.nemo_rl.test_recipe import replay_recipe

    calls = []
    nemo = _nemo_rl_stand_in(tmp_path, replay_recipe(), calls)
    code = run_grpo.main(["--config", "x.yaml", "policy.generation.vllm_kwargs.max_logprobs=20",
                          "policy.generation.vllm_cfg.async_engine=true"], nemo=nemo)
    err = capsys.readouterr().err
    assert code == 2 and "policy.generation.vllm_kwargs.max_logprobs=20: set an int >= 65" in err
    assert "policy.generation.vllm_cfg.async_engine=True: set false" in err
    assert [c[0] for c in calls] == ["register_omegaconf_resolvers", "load_config", "parse_hydra_overrides"]
    with pytest.raises(SystemExit):
        run_grpo.main([], nemo=nemo)  # --config is required, as the usage line says


def test_the_launchers_check_prints_what_replay_asks_and_starts_nothing(tmp_path, capsys):
    """``--check``: the recipe loaded and checked exactly as a run loads it, then what replay runs
    with and asks of vLLM, and no Ray (a good recipe was confirmable only by starting a cluster)."""
    from nemo_replay.integrations.nemo_rl import run_grpo
    from tests.integrations.nemo_rl.test_recipe import replay_recipe

    calls = []
    recipe = replay_recipe()
    recipe["grpo"]["val_period"] = 10
    nemo = _nemo_rl_stand_in(tmp_path, recipe, calls)
    assert run_grpo.main(["--config", "x.yaml", "--check"], nemo=nemo) == 0
    out = capsys.readouterr().out
    assert [c[0] for c in calls] == ["register_omegaconf_resolvers", "load_config"]  # no Ray, no setup
    assert "vLLM is asked logprobs=81 per token (max_logprobs=81, logprobs_mode=processed_logprobs" in out
    assert "generation_support one compact SampleRows a sample: supports up to 80 ids read whole" in out
    assert "validation (grpo.val_period=10) samples with the same top_k / top_p" in out
    assert "no cluster was started (--check)" in out
    calls.clear()
    code = run_grpo.main(["--config", "x.yaml", "--check", "policy.generation.vllm_kwargs.max_logprobs=65"], nemo=nemo)
    out = capsys.readouterr().out
    assert code == 0 and "logprobs=65 per token" in out and "(ties past that are flagged: max_logprobs=81 reads 80)" in out


def test_the_plug_acts_on_replay_runs_only_and_can_be_removed(tmp_path):
    """With the data path installed in the process, NeMo-RL's own tests failed on the plug's errors
    (42 of them): a batch from a run without replay had no rows and was refused. Now a batch with
    no rows passes through untouched outside a replay run, a replay run (``replay_run``) still
    refuses a generated message without rows and names its generation worker, and ``remove``
    puts NeMo-RL's functions back."""
    from nemo_replay.integrations.nemo_rl.datapath import replay_run

    grpo, bdd, rollouts = _stand_ins(tmp_path)
    originals = (grpo.add_grpo_token_loss_masks_and_generation_logprobs, grpo._preserve_router_replay_routed_experts,
                 grpo.batched_message_log_to_flat_message, bdd.BatchedDataDict.__dict__["from_batches"])
    done = install_data_path(grpo=grpo, batched_data_dict=bdd, rollouts=rollouts)
    plain = _multi_turn_logs()
    for log in plain:
        for m in log:
            m.pop("generation_support", None)
    grpo.add_grpo_token_loss_masks_and_generation_logprobs(plain)  # a run without replay: untouched
    assert not any("generation_support" in m for log in plain for m in log)
    target = {"input_ids": torch.zeros(1, 3)}
    grpo._preserve_router_replay_routed_experts(target, {}, {})
    assert "generation_support" not in target
    with replay_run(worker="nemo_replay.integrations.nemo_rl.workers.ReplayVllmGenerationWorker"):
        with pytest.raises(ValueError, match=r"was generated but carries no generation_support: this replay run's "
                                             r"generation worker \(nemo_replay.*ReplayVllmGenerationWorker\) returned no rows"):
            grpo.add_grpo_token_loss_masks_and_generation_logprobs(_without_one_row())
        with pytest.raises(ValueError, match="the flattened rollout batch has no 'generation_support'"):
            grpo._preserve_router_replay_routed_experts({"input_ids": torch.zeros(1, 3)}, {}, {})
    logs = _multi_turn_logs()  # rows in a batch are still checked outside a run
    logs[0][3]["generation_support"] = logs[0][3]["generation_support"][:1]
    with pytest.raises(ValueError, match=r"trajectory 0, message 3: generation_support must be the rows of its 2 tokens"):
        grpo.add_grpo_token_loss_masks_and_generation_logprobs(logs)
    done.remove()
    assert (grpo.add_grpo_token_loss_masks_and_generation_logprobs, grpo._preserve_router_replay_routed_experts,
            grpo.batched_message_log_to_flat_message, bdd.BatchedDataDict.__dict__["from_batches"]) == originals


def _without_one_row():
    logs = _multi_turn_logs()
    del logs[1][2]["generation_support"]
    return logs


def _rank_result(num_prompts, rows=True):
    """One data-parallel rank's generate result: the keys VllmGeneration.generate requires (vllm_generation.py:681)."""
    out = {"output_ids": torch.zeros(num_prompts, 4, dtype=torch.int64), "generation_lengths": torch.ones(num_prompts),
           "unpadded_sequence_lengths": torch.ones(num_prompts), "logprobs": torch.zeros(num_prompts, 4)}
    if rows:
        out["generation_support"] = [SampleRows.none(4) for _ in range(num_prompts)]
    return out


def test_a_missing_rows_error_names_the_ranks_that_returned_none_or_the_rollout_code(tmp_path):
    """A generated message without rows said only that the run's worker returned none *or* the rollout
    code lost them. Inside a replay run the data path now notes which data-parallel ranks of each
    generate call returned rows: a call where some did and some did not is refused naming them, and a
    message without rows names the ranks of the last call that returned none, or says that all
    returned rows and the rollout code did not slice them in. Outside a run nothing is noted."""
    from nemo_replay.integrations.nemo_rl.datapath import replay_run

    grpo, bdd, rollouts = _stand_ins(tmp_path)
    done = install_data_path(grpo=grpo, batched_data_dict=bdd, rollouts=rollouts)
    worker = "nemo_replay.integrations.nemo_rl.workers.ReplayVllmGenerationWorker"
    join, add_masks = bdd.BatchedDataDict.from_batches, grpo.add_grpo_token_loss_masks_and_generation_logprobs
    join([_rank_result(2), _rank_result(2, rows=False)])  # outside a run: NeMo-RL's from_batches decides
    assert len(bdd.calls) == 1
    with replay_run(worker=worker):
        with pytest.raises(ValueError, match=r"the vLLM workers of data-parallel ranks \[1, 2\] \(of 3\) returned no "
                                             r"generation_support while ranks \[0\] did: the worker of ranks \[1, 2\] "
                                             r"is not this replay run's \(nemo_replay.*ReplayVllmGenerationWorker\)"):
            join([_rank_result(2), _rank_result(1, rows=False), _rank_result(3, rows=False)])
        join([_rank_result(2), _rank_result(0, rows=False)])  # a rank given no prompts returned nothing to miss
        join([_rank_result(2, rows=False), _rank_result(2, rows=False)])
        join([{"input_ids": torch.zeros(2, 3)}])  # not a generate call: the last one still stands
        with pytest.raises(ValueError, match=r"trajectory 1, message 2 .* carries no generation_support: the last "
                                             r"generate call's vLLM workers returned no rows \(data-parallel ranks "
                                             r"\[0, 1\] of 2\): the worker that answered there is not this replay "
                                             r"run's generation worker \(nemo_replay.*ReplayVllmGenerationWorker\)"):
            add_masks(_without_one_row())
        join([_rank_result(2), _rank_result(2)])
        with pytest.raises(ValueError, match=r"carries no generation_support: the last generate call's vLLM workers "
                                             r"all returned rows \(2 data-parallel ranks\), so the rollout code that "
                                             r"built this message did not slice them in .*patch apply NEMO_RL_DIR"):
            add_masks(_without_one_row())
    with pytest.raises(ValueError, match=r"carries no generation_support: the rollout code did not slice the vLLM "
                                         r"worker's rows into it .*, or the generation worker is not replay's"):
        add_masks(_without_one_row())  # outside the run: rows in the batch are checked, the run's calls forgotten
    done.remove()


def test_the_vllm_worker_takes_the_sampling_mask_where_the_engine_returns_it():
    """An engine started with ``return_sampling_mask`` (vLLM >= 0.33, Model Runner V2) returns each
    token's exact support: the request keeps NeMo-RL's ``logprobs=0`` and the rows come from the
    masks (the engine's ``model_config.return_sampling_mask``, vllm/config/model.py)."""
    from types import SimpleNamespace

    top_k = 6
    data, outputs, logits = _engine_batch(top_k)
    for out in outputs:  # the same completions as vLLM 0.33 returns them for logprobs=0 with masks on
        gen = out.outputs[0]
        masks = [sorted({t for t, lp in pos.items() if lp.logprob > float("-inf")}) for pos in gen.logprobs]
        own = [{t: pos[t]} for t, pos in zip(gen.token_ids, gen.logprobs)]  # the sampled token's entry only
        out.outputs[0] = gen.__class__(**{**vars(gen), "logprobs": own, "sampling_mask": SamplingMask(masks)})
    llm = _LLM(outputs)
    # max_logprobs below top_k + 1: no log-prob list could show a support, a mask does.
    llm.llm_engine = SimpleNamespace(model_config=SimpleNamespace(return_sampling_mask=True, max_logprobs=top_k - 1))
    worker_cls = type("W", (workers.ReplayVllmMixin, _NemoRLVllmWorker), {})
    result = worker_cls({"temperature": TEMPERATURE, "top_p": 0.9, "top_k": top_k}, llm).generate(data)
    assert llm.params[-1].logprobs == 0  # NeMo-RL's own request, unchanged
    windows = [e[0 : result["output_ids"].shape[1]] for e in result["generation_support"]]
    decoded = [_decoded(w, result["output_ids"][i]) for i, w in enumerate(windows)]
    assert all(len(r) <= top_k + 16 for d in decoded for r in d)  # the mask path's rows: top_k + 16 tied ids whole
    assert all(int(result["output_ids"][i, c]) in r for i, d in enumerate(decoded) for c, r in enumerate(d) if r)
    token_mask = torch.stack([w.recorded() for w in windows]).float()
    batch = {"input_ids": result["output_ids"], "input_lengths": torch.tensor([7, 7]), "token_mask": token_mask,
             "sample_mask": torch.ones(2), "generation_support": windows}
    scores = next_token_logprobs(logits / TEMPERATURE, batch)
    active = token_mask[:, 1:] != 0
    assert int(active.sum()) == 6
    torch.testing.assert_close(scores.logprobs[active], result["logprobs"][:, 1:][active], atol=1e-5, rtol=0)
