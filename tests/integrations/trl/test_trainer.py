"""ReplayGRPOTrainer: TRL 1.16's GRPOTrainer with replay, trained for real on CPU.

The model is a tiny Llama built from a config and saved to a temporary folder with a local
word-level tokenizer (no download); TRL loads policy and reference from that folder, as it
does for any checkpoint path. Every run pins ``bf16=False``: on CPU ``GRPOConfig`` turns bf16
autocast on for the trainer's forward by default while ``generate`` runs in float32, which
is a numeric gap of its own (measured in :func:`test_bf16_autocast_gap_is_reported_apart`).
"""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict  # noqa: E402

from nemo_replay.integrations.trl import ReplayGRPOTrainer, ReplaySettings  # noqa: E402
from nemo_replay.integrations.trl.records import RECORDS_KEY, completion_channels, records_from_vllm  # noqa: E402
from nemo_replay.rollout.capture.hf import check_generation_config  # noqa: E402
from nemo_replay.rollout.capture.sampler import check_capture_settings, sample  # noqa: E402
from nemo_replay.rollout.engines.vllm import vllm_row_width  # noqa: E402

WORDS = ["<pad>", "<eos>", "<bos>"] + [f"w{i}" for i in range(45)]  # V = 48
EOS = 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer in a local folder."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=EOS, bos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions: truncation matters
    model.generation_config = transformers.GenerationConfig(eos_token_id=EOS, pad_token_id=0, bos_token_id=2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _dataset(n: int = 32) -> Dataset:
    """Prompts of 1 to 4 distinct words (left padding differs per row)."""
    return Dataset.from_dict({"prompt": [" ".join(f"w{(3 * i + j) % 45}" for j in range(1 + i % 4)) for i in range(n)]})


def reward_w7(completions, **kwargs):
    """Verifiable reward: how often the completion says w7."""
    return [float(c.split().count("w7")) for c in completions]


def _args(out, **over) -> GRPOConfig:
    base = dict(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        max_steps=2, steps_per_generation=2, gradient_accumulation_steps=2, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        top_k=5, top_p=0.9, temperature=0.9, beta=0.02, learning_rate=5e-3, save_strategy="no", seed=7,
        disable_tqdm=True,
    )
    base.update(over)
    return GRPOConfig(**base)


def _trainer(cls, checkpoint, out, replay=None, **over):
    kwargs = {} if replay is None else {"replay": replay}
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    return cls(model=checkpoint, reward_funcs=reward_w7, args=_args(out, **over), train_dataset=_dataset(),
               processing_class=tok, **kwargs)


def _logged(trainer, key):
    return [r[key] for r in trainer.state.log_history if key in r]


def _fresh_batch(trainer):
    """One more generation batch with the trained weights (TRL's own dataloader and generation)."""
    trainer.model.train()
    inputs = next(iter(trainer.get_train_dataloader()))
    return trainer._generate_and_score_completions(inputs)


@pytest.fixture(scope="module")
def trained(checkpoint, tmp_path_factory):
    """ReplayGRPOTrainer after 2 GRPO steps (shuffled and split batches, reference model), per mode."""
    runs = {}
    for source in ("logits", "hidden"):
        trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path_factory.mktemp(source), replay=ReplaySettings(source=source))
        trainer.train()
        runs[source] = trainer
    return runs


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_replay_reproduces_the_sampler_where_trl_scoring_does_not(trained, source):
    """Replay mismatch <= 1e-5 at every step; on one more batch of the same run TRL's own scoring is >= 0.1 off."""
    trainer = trained[source]
    worst = _logged(trainer, "replay/mismatch_max")
    assert len(worst) == 2 and max(worst) <= 1e-5
    assert all(math.isfinite(v) for v in _logged(trainer, "loss")) and _logged(trainer, "kl")[1] > 0
    # The same run, one more batch: TRL's fused full-vocabulary scoring against the sampler's log-probs.
    batch = _fresh_batch(trainer)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    C = batch["completion_ids"].shape[1]
    ch = completion_channels(batch[RECORDS_KEY], batch["completion_ids"], batch["completion_mask"])
    with torch.no_grad():
        trl_lp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, C)
        with trainer._scoring(batch[RECORDS_KEY], measure=True):
            replay_lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    active = ch.channels.loss_mask
    assert (ch.rollout_logprobs - replay_lp).abs()[active].max() <= 1e-5
    trl_gap = (ch.rollout_logprobs - trl_lp).abs()[active]
    assert trl_gap.mean() >= 0.1
    assert torch.allclose(batch["sampling_per_token_logps"][active], ch.rollout_logprobs[active])  # TRL keeps ours
    if source == "logits":
        # The logged full-vocabulary mismatch is TRL's own scoring, derived from the same forward.
        trainer.log({})
        assert trainer.state.log_history[-1]["replay/full_vocab_mismatch_mean"] == pytest.approx(float(trl_gap.mean()), rel=1e-3)
        assert 0 < trainer.state.log_history[-1]["replay/support_mass_mean"] < 1


def test_hidden_mode_trains_like_logits_mode(trained):
    """Same seed, same rollouts: hidden mode's losses and gradient norms are logits mode's."""
    logits, hidden = trained["logits"], trained["hidden"]
    assert _logged(hidden, "reward")[:2] == _logged(logits, "reward")[:2]  # the 2 training steps
    assert _logged(hidden, "loss") == pytest.approx(_logged(logits, "loss"), rel=1e-4, abs=1e-7)
    assert _logged(hidden, "grad_norm") == pytest.approx(_logged(logits, "grad_norm"), rel=1e-4)


def test_trl_trainer_unchanged_next_to_it(checkpoint, tmp_path, trained):
    """TRL's GRPOTrainer as is; ReplaySettings(enabled=False) is it exactly; replay samples the same tokens."""
    plain = _trainer(GRPOTrainer, checkpoint, tmp_path / "trl")
    plain.train()
    off = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path / "off", replay=ReplaySettings(enabled=False))
    off.train()
    on = trained["logits"]
    for key in ("loss", "grad_norm", "reward", "entropy", "kl", "completions/mean_length"):
        assert _logged(off, key) == _logged(plain, key), key
    assert not any(k.startswith("replay/") for r in off.state.log_history for k in r)
    # The capture hooks do not perturb sampling: the first rollouts are TRL's own.
    assert _logged(on, "reward")[0] == _logged(plain, "reward")[0]
    assert _logged(on, "completions/mean_length")[0] == _logged(plain, "completions/mean_length")[0]
    assert _logged(on, "loss") != _logged(plain, "loss")  # scored over the supports
    # Entropy: TRL's `entropy` is now the support entropy; TRL's own full-vocabulary entropy is logged
    # beside it. First step: same weights, same rollouts, so it is TRL's number (2.04 vs 1.10 nats).
    full, support = _logged(on, "replay/full_vocab_entropy"), _logged(on, "entropy")
    assert len(full) == len(support) == 2
    assert full[0] == pytest.approx(_logged(plain, "entropy")[0], rel=1e-5)
    assert all(0 < s < f for s, f in zip(support, full))
    assert not any("replay/full_vocab_entropy" in r for r in trained["hidden"].state.log_history)


def test_records_follow_their_rows_through_trl_shuffle_and_split(checkpoint, tmp_path):
    """TRL's own shuffle_sequence_dict and split_tensor_dict move each record with its row."""
    trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path)
    batch = _fresh_batch(trainer)
    torch.manual_seed(11)
    for part in split_tensor_dict(shuffle_sequence_dict(batch), 2):
        completion_channels(part[RECORDS_KEY], part["completion_ids"], part["completion_mask"])
    records = list(batch[RECORDS_KEY])
    swapped = [records[1], records[0], *records[2:]]
    if not torch.equal(records[0].token_ids, records[1].token_ids):
        with pytest.raises(ValueError, match="were separated"):
            completion_channels(swapped, batch["completion_ids"], batch["completion_mask"])
    with pytest.raises(ValueError, match="3 support records for a batch of"):
        completion_channels(records[:3], batch["completion_ids"], batch["completion_mask"])
    short = batch["completion_mask"].clone()
    row = int(torch.nonzero(short.sum(1) > 1)[0])
    short[row, int(short[row].sum()) - 1] = 0
    with pytest.raises(ValueError, match=f"completion {row} has .* loss-active positions"):
        completion_channels(records, batch["completion_ids"], short)
    del batch[RECORDS_KEY]
    with pytest.raises(ValueError, match="the batch has no 'replay_records'"):
        trainer._compute_loss(trainer.model, batch)


def test_vllm_records_need_the_request_parameters():
    with pytest.raises(ValueError, match=r"sampling_params must be the request's parameters as a dict .* got NoneType"):
        records_from_vllm([[3]], [[[-0.1]]], [[[3]]], width=None, vocab_size=48, sampling_params=None)


def test_a_support_tied_at_the_kth_value_is_read_whole_with_the_requested_logprobs():
    """vLLM < 0.33 keeps every token tied with the k-th value in a step of fewer than 8 rows
    (v1/sample/ops/topk_topp_sampler.py:345-360 in 0.25.1): at top_k = 4 a row of 6. With
    ``top_k + 1`` log-probs the list shows 5 finite entries and no filtered one, so the support
    is not known whole; the trainer's request (the tie margin) shows it, and it is read. The lists
    are what TRL 1.16 hands over: each position's entries sorted by rank, ``-inf`` for filtered
    tokens (trl/generation/vllm_generation.py:70-95, ``extract_logprobs``)."""
    top_k, vocab = 4, 48
    x = torch.full((vocab,), -math.inf, dtype=torch.float64)
    x[10:16] = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 1.0])  # ids 12..15 tie at the 4th value
    processed = x - torch.logsumexp(x[10:16], 0)
    ranked = sorted(range(vocab), key=lambda t: (-processed[t], t))

    def read(n: int):
        ids = [ranked[:n]]
        lps = [[float(processed[t]) if math.isfinite(processed[t]) else -math.inf for t in ranked[:n]]]
        params = dict(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, repetition_penalty=1.0, logprobs=n)
        return records_from_vllm([[10]], [lps], [ids], width=None, vocab_size=vocab, sampling_params=params)

    with pytest.raises(ValueError, match=r"positions \[0\] do not show their whole support"):
        read(top_k + 1)
    requested = vllm_row_width(top_k, 20) + 1  # what ReplayGRPOTrainer asks colocated vLLM for at top_k = 4
    assert requested == 20
    (record,) = read(requested)
    rows = _decoded(record)  # the compact form a record keeps, decoded
    assert sorted(int(t) for t in rows.values.reshape(-1).tolist() if t >= 0) == [10, 11, 12, 13, 14, 15]


def _decoded(record):
    """A record's rows decoded as the scorer decodes them, one row a completion token."""
    from nemo_replay.support.rows import batch_rows

    n = record.token_ids.numel()
    rows, row_ids = batch_rows([record.support], record.token_ids[None], torch.tensor([n]), name="records")
    assert torch.equal(row_ids[0], torch.arange(n))
    return rows.decode("cpu", check=True)


@pytest.mark.parametrize(
    "over, replay, match",
    [
        (dict(top_k=0, top_p=1.0), None, "samples from the whole vocabulary"),
        (dict(repetition_penalty=1.2), None, "repetition_penalty=1.2"),
        (dict(temperature=0.0), None, "temperature"),
        (dict(), dict(source="hidden", chunk_size=0), "chunk_size=0 must be an int >= 1"),
        (dict(), dict(sources="hidden"), r"unknown setting\(s\) \['sources'\]"),
    ],
)
def test_setups_replay_cannot_serve_are_refused(checkpoint, tmp_path, over, replay, match):
    with pytest.raises(ValueError, match=match):
        _trainer(ReplayGRPOTrainer, checkpoint, tmp_path, replay=replay, **over)


def test_custom_rollouts_and_softcapped_hidden_mode_are_refused(checkpoint, tmp_path):
    def rollout(prompts, trainer):  # a custom rollout returns no supports
        return {"prompt_ids": [], "completion_ids": [], "logprobs": []}

    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="rollout_func: a custom rollout returns no supports"):
        ReplayGRPOTrainer(model=checkpoint, reward_funcs=reward_w7, args=_args(tmp_path), train_dataset=_dataset(),
                          processing_class=tok, rollout_func=rollout)
    torch.manual_seed(0)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, final_logit_softcapping=30.0, pad_token_id=0,
        eos_token_id=EOS, bos_token_id=2,
    ))
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 makes its logits differ"):
        ReplayGRPOTrainer(model=gemma, reward_funcs=reward_w7, args=_args(tmp_path, beta=0.0), train_dataset=_dataset(),
                          processing_class=tok, replay=ReplaySettings(source="hidden"))


class VLLMGenerationOutputs:
    """What TRL's ``VLLMGeneration`` returns, computed from the policy's own logits.

    ``generate`` returns ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)``
    (trl/generation/vllm_generation.py, ``VLLMGeneration.generate``, lines 550-575): per
    position the entries of vLLM's processed log-probs (``logprobs_mode="processed_logprobs"``,
    set at line 361: members finite, filtered tokens ``-inf``), ``logprobs`` of them plus
    the sampled token, re-sorted by rank by ``extract_logprobs`` (lines 70-99). Tokens are
    drawn like vLLM's Triton top-k/top-p kernel (``capture.sample(ties="index_order")``).
    """

    def __init__(self, trainer, top_k, top_p, temperature, max_tokens):
        self.trainer, self.top_k, self.top_p, self.temperature, self.max_tokens = trainer, top_k, top_p, temperature, max_tokens
        self.logprobs = 0
        self.synced = 0

    def sync_weights(self):
        self.synced += 1

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        model = self.trainer.model
        completions, lps, ids = [], [], []
        g = torch.Generator().manual_seed(len(completions) + 3)
        for prompt in prompts:
            seq, comp, pos_lps, pos_ids = list(prompt), [], [], []
            for _ in range(self.max_tokens):
                z = model(input_ids=torch.tensor([seq])).logits[:, -1].float()
                tok, _, support = sample(z, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, generator=g)
                x = z[0].double() / self.temperature
                members = [int(t) for t in support.to_padded().values[0] if t >= 0]
                processed = torch.full_like(x, -math.inf)
                processed[members] = x[members] - torch.logsumexp(x[members], 0)
                ranked = sorted(range(x.numel()), key=lambda t: (-processed[t], t))[: self.logprobs]
                order = ranked if int(tok) in ranked else ranked + [int(tok)]
                pos_ids.append(order)
                pos_lps.append([float(processed[t]) for t in order])
                comp.append(int(tok))
                seq.append(int(tok))
                if int(tok) == EOS:
                    break
            completions.append(comp)
            lps.append(pos_lps)
            ids.append(pos_ids)
        return prompts, completions, lps, ids


def test_vllm_path_reads_processed_logprobs_and_fixes_trl_importance_ratio(checkpoint, tmp_path):
    """use_vllm with TRL's output contract: supports from top_k + 1 processed log-probs; IS ratio -> 1."""
    trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path, max_steps=1)
    trainer.use_vllm, trainer.vllm_mode, trainer._last_loaded_step = True, "colocate", -1
    trainer.vllm_generation = VLLMGenerationOutputs(trainer, top_k=5, top_p=0.9, temperature=0.9, max_tokens=6)
    trainer.vllm_generation.logprobs = trainer._vllm_logprobs(trainer.top_k)  # what __init__ sets with use_vllm=True
    assert trainer.vllm_generation.logprobs == min(trainer.top_k + 16, 19) + 1  # the tie margin, under max_logprobs 20
    trainer.train()
    assert trainer.vllm_generation.synced == 1
    assert _logged(trainer, "replay/mismatch_max")[0] <= 1e-5
    ratio = _logged(trainer, "sampling/importance_sampling_ratio/mean")[0]
    assert ratio == pytest.approx(1.0, abs=1e-5)  # TRL's own scoring would correct by exp(-log mass)
    assert _logged(trainer, "sampling/sampling_logp_difference/max")[0] <= 1e-5
    # What construction with use_vllm=True checks: a bounded top-k, and colocated vLLM's max_logprobs (20).
    assert "top_k > 1 bounds it" in trainer._vllm_problems(None)[0]
    assert "at most 20 log-probs per token" in trainer._vllm_problems(24)[0]
    assert trainer._vllm_problems(5) == []


def test_bf16_autocast_gap_is_reported_apart(checkpoint, tmp_path):
    """GRPOConfig's CPU default (bf16 autocast for the trainer, float32 generate): a numeric gap, reported apart."""
    trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path, bf16=True)
    trainer.train()
    numeric, gap = _logged(trainer, "replay/mismatch_max"), _logged(trainer, "replay/normalisation_gap_mean")
    assert all(1e-4 < v < 0.1 for v in numeric)  # bf16 rounding of the trainer's logits; float32 gives ~2e-7
    assert all(v > 0.1 for v in gap)  # what replay removes, on the same tokens
    assert all(m < g for m, g in zip(_logged(trainer, "replay/mismatch_mean"), gap))


def _problem_lines(check, *args, **kwargs) -> list[str]:
    """The problem lines of a check's ValueError, as ReplayGRPOTrainer lists them."""
    with pytest.raises(ValueError) as info:
        check(*args, **kwargs)
    return [line.strip()[2:] for line in str(info.value).splitlines()[1:]]


@pytest.mark.parametrize(
    "over, expected",
    [
        (dict(temperature=0.0), lambda: _problem_lines(check_capture_settings, temperature=0.0)),
        (dict(top_p=1.5), lambda: _problem_lines(check_capture_settings, temperature=0.9, top_p=1.5)),
        (dict(top_k=-1), lambda: _problem_lines(check_capture_settings, temperature=0.9, top_k=-1)),
        (dict(repetition_penalty=1.2), lambda: _problem_lines(
            check_generation_config, transformers.GenerationConfig(do_sample=True, temperature=0.9, repetition_penalty=1.2))),
    ],
    ids=["temperature", "top_p", "top_k", "repetition_penalty"],
)
def test_each_refusal_is_listed_once(checkpoint, tmp_path, over, expected):
    """A GRPOConfig setting checked both as GRPOConfig and as the GenerationConfig TRL builds from it was listed twice."""
    lines = expected()
    assert len(lines) == 1
    with pytest.raises(ValueError) as info:
        _trainer(ReplayGRPOTrainer, checkpoint, tmp_path, **over)
    assert str(info.value) == "ReplayGRPOTrainer cannot replay this setup:\n  - " + lines[0]


def test_truncation_set_in_generation_kwargs_is_read_as_trl_builds_it(checkpoint, tmp_path):
    """generation_kwargs override GRPOConfig's sampling fields (grpo_trainer.py:1171-1173): read them there."""
    trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path / "k20", top_k=0, top_p=1.0,
                       generation_kwargs={"top_k": 20}, max_steps=1)
    assert trainer.generation_config.top_k == 20  # what TRL's generate samples with
    trainer.train()
    assert _logged(trainer, "replay/mismatch_max")[0] <= 1e-5
    batch = _fresh_batch(trainer)
    widths = {r.support.values.shape[1] for r in batch[RECORDS_KEY] if hasattr(r.support, "values")}
    assert widths <= {20}  # fixed-width rows of the effective top-k (ties would make a row ragged)
    # The override works the other way too: generation_kwargs that lift the truncation are refused.
    with pytest.raises(ValueError, match="samples from the whole vocabulary"):
        _trainer(ReplayGRPOTrainer, checkpoint, tmp_path / "k0", generation_kwargs={"top_k": 0, "top_p": 1.0})
    with pytest.raises(ValueError, match=r"generation_kwargs temperature=0.5 samples at another temperature than "
                                         r"GRPOConfig.temperature=0.9"):
        _trainer(ReplayGRPOTrainer, checkpoint, tmp_path / "t", generation_kwargs={"temperature": 0.5})


@pytest.mark.parametrize("cast", [False, True])
def test_cast_lm_head_to_fp32_scores_float32_logits(checkpoint, tmp_path, cast):
    """Logits mode under bf16 autocast: with cast_lm_head_to_fp32 the scorer gets float32 head logits.

    TRL casts the head to float32 and projects float32 hidden states outside autocast
    (trl/trainer/grpo_trainer.py:1011-1047; trl/trainer/utils.py add_fused_lm_head). Before the
    fix the head ran inside autocast either way: bf16 values, the same mismatch with and without.
    """
    trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path, bf16=True, cast_lm_head_to_fp32=cast)
    model = trainer.model
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    C = 3
    own_forward = vars(model.lm_head).get("forward")
    assert (own_forward is not None) == cast  # TRL's cast replaces the head's forward on the instance
    kept = {}
    hook = model.model.register_forward_hook(lambda _m, _a, out: kept.__setitem__("hidden", out.last_hidden_state))
    try:
        with torch.no_grad(), trainer.accelerator.autocast():
            source, _, _ = trainer._replay_forward(model, ids, mask, C, False)
    finally:
        hook.remove()
    assert vars(model.lm_head).get("forward") is own_forward  # TRL's cast forward (or none) is back after the pass
    float32_head = torch.nn.functional.linear(kept["hidden"][:, -C - 1 : -1].float(), model.lm_head.weight.float())
    gap = float((source.float() - float32_head).abs().max())
    if cast:
        assert gap <= 1e-5
    else:
        assert gap > 1e-3  # bf16 rounding of the projection (the default, as TRL's fused head without the flag)


def test_cast_lm_head_to_fp32_moves_logits_mode_onto_hidden_mode(checkpoint, tmp_path):
    """One bf16 step: logits mode with the flag scores as hidden mode does (float32 projection), without it not."""
    runs = {}
    for name, source, cast in (("logits", "logits", False), ("logits_fp32", "logits", True), ("hidden", "hidden", False)):
        trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path / name, replay=ReplaySettings(source=source),
                           bf16=True, cast_lm_head_to_fp32=cast, max_steps=1)
        trainer.train()
        runs[name] = _logged(trainer, "replay/mismatch_mean")[0]
    assert runs["logits_fp32"] == pytest.approx(runs["hidden"], rel=1e-3)
    assert abs(runs["logits"] - runs["logits_fp32"]) > 0.1 * runs["logits_fp32"]


def test_colocated_vllm_is_asked_for_flat_logprobs_and_trl_reads_them_as_the_dicts(checkpoint, tmp_path, monkeypatch):
    """vLLM 0.24+ has ``SamplingParams.flat_logprobs`` (vllm/sampling_params.py:284 in 0.24.0): colocated, the request
    asks it through ``generation_kwargs`` (TRL passes them into SamplingParams, vllm_generation.py:662-683), and TRL's
    own ``extract_logprobs`` (vllm_generation.py:70-99) reads a FlatLogprobs position by position as it reads dicts."""
    import sys
    import types

    from trl.generation.vllm_generation import extract_logprobs

    from tests.rollout.engines.engine_outputs import RequestOutput, vllm_offline_output, vllm_steps

    def installed(*fields):
        module = types.ModuleType("vllm")
        module.SamplingParams = type("SamplingParams", (), {"__struct_fields__": ("n", "temperature", "logprobs", *fields)})
        monkeypatch.setitem(sys.modules, "vllm", module)

    trainer = _trainer(ReplayGRPOTrainer, checkpoint, tmp_path, max_steps=1)
    trainer.use_vllm, trainer.vllm_mode = True, "colocate"
    asked = {}
    for fields, mode in (((), "colocate"), (("flat_logprobs",), "server"), (("flat_logprobs",), "colocate")):
        installed(*fields)
        trainer.vllm_mode = mode
        trainer.vllm_generation = VLLMGenerationOutputs(trainer, top_k=5, top_p=0.9, temperature=0.9, max_tokens=6)
        trainer.vllm_generation.generation_kwargs = {"min_p": 0.0}
        trainer._replay_vllm_request()
        asked[(fields, mode)] = dict(trainer.vllm_generation.generation_kwargs)
        assert trainer.vllm_generation.logprobs == trainer._vllm_logprobs(trainer.top_k)
    assert asked[((), "colocate")] == {"min_p": 0.0}  # vLLM 0.22 / 0.23: no such field
    assert asked[(("flat_logprobs",), "server")] == {"min_p": 0.0}  # trl vllm-serve's request is TRL's
    assert asked[(("flat_logprobs",), "colocate")] == {"min_p": 0.0, "flat_logprobs": True}
    # The same response through TRL's extraction, dicts and flat: the same lists, the same records.
    logits = torch.randn(7, 48, generator=torch.Generator().manual_seed(4)) * 2
    n = vllm_row_width(5, 20) + 1
    steps = vllm_steps(logits, 0.9, top_k=5, top_p=0.9, num_logprobs=n)
    outs = [RequestOutput("r", None, [1, 2], None, [vllm_offline_output(steps, n, flat=flat)], True) for flat in (False, True)]
    (lp_d, ids_d), (lp_f, ids_f) = (extract_logprobs([o]) for o in outs)
    assert lp_d == lp_f and ids_d == ids_f
    params = dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.0, logprobs=n)
    completions = [[s.token for s in steps]]
    a = records_from_vllm(completions, lp_d, ids_d, width=None, vocab_size=48, sampling_params=params)
    b = records_from_vllm(completions, lp_f, ids_f, width=None, vocab_size=48, sampling_params=params)
    assert torch.equal(_decoded(a[0]).values, _decoded(b[0]).values)
    assert [sorted(t for t in r if t >= 0) for r in _decoded(a[0]).values.tolist()] == [s.mask for s in steps]
