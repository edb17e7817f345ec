"""Replay's rollout side in verl 0.9.1: supports from the servers, through the agent loops, into the batch.

What runs is verl's own code unless named: the composed Hydra config (``configs/verl/
replay_fsdp.yaml`` over verl's ``ppo_trainer``), ``RolloutConfig`` / ``HFModelConfig`` (a tiny
Llama folder: tokenizer and config), ``TokenOutput``, ``AgentLoopWorker.generate_sequences``
with its sampling parameters, ``_run_agent_loop`` (Hydra instantiation from verl's registry),
``_agent_loop_postprocess`` padding and ``_postprocess`` batching into a ``DataProto``,
``SingleTurnAgentLoop`` and ``ToolAgentLoop`` (the hermes tool parser, a ``FunctionTool``,
the Continuous Token builder's merges), ``AgentLoopOutput.as_dict`` and
``list_of_dict_to_tensordict`` (the V1 TransferQueue path), ``DataProto.concat``.

Stand-ins, because vLLM and SGLang do not run on a CPU machine:

- the engine: ``SampledEngine.generate`` yields ``RequestOutput``s built field for field as
  vLLM 0.33 builds them (``tests/rollout/engines/engine_outputs.py``), sampling scripted tokens from
  known logits with top-k (the sampler's support is the reference);
- verl's server around it: ``VerlVllmServer.generate`` does what ``vLLMHttpServer.generate``
  does with the engine (lines cited on it), and replay's server is replay's mixin over it, as
  :func:`replay_vllm_replica_class` mixes it over verl's class;
- verl's ``LLMServerClient.generate`` (a Ray actor call): :class:`Client` calls the server
  with a copy of the sampling parameters, as Ray does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 is not installed here; .ci/run builds its own environment for these tests")
pytest.importorskip("cachetools", reason="verl's agent loop needs verl[verl-core]'s cachetools (the nemo_replay[verl] extra)")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.tools.function_tool import FunctionTool  # noqa: E402
from verl.tools.schemas import OpenAIFunctionSchema, OpenAIFunctionToolSchema  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402
from verl.workers.config import HFModelConfig  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from nemo_replay.integrations.verl import PAD_ID, SUPPORT_KEY  # noqa: E402
from nemo_replay.integrations.verl.agent_loop import (  # noqa: E402
    FLAGGED_KEY,
    ReplayAgentLoopOutput,
    ReplayAgentLoopWorker,
    register_agent_loops,
)
from nemo_replay.integrations.verl.rollout import (  # noqa: E402
    FLAGS_KEY,
    RolloutReplay,
    SglangSupportRecorder,
    _VllmServerReplay,
    attach_support,
)
from nemo_replay.integrations.verl.engine import read_responses  # noqa: E402
from nemo_replay.integrations.verl.response_rows import (  # noqa: E402
    buffers_of,
    compact_rows,
    encode_response_rows,
    turn_rows,
)
from nemo_replay.support.ragged import RaggedSupport  # noqa: E402
from tests.integrations.verl.engine_batches import buffer_rows, dense_from_compact  # noqa: E402
from nemo_replay.support.rows import SampleRows  # noqa: E402
from nemo_replay.support.errors import SupportAlignmentError  # noqa: E402
from tests.integrations.verl.conftest import TOKENS  # noqa: E402
from tests.rollout.engines.engine_outputs import (  # noqa: E402
    RequestOutput,
    sglang_meta_info,
    sglang_steps,
    vllm_offline_output,
    vllm_steps,
)

CONFIG_DIR = str(__import__("pathlib").Path(__file__).resolve().parents[3] / "configs" / "verl")
V = len(TOKENS)
TOP_K = 4
EOS = TOKENS.index("<|im_end|>")
T = {t: i for i, t in enumerate(TOKENS)}


def verl_config(model_dir, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="replay_fsdp", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.rollout.top_k={TOP_K}",
            f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs={TOP_K + 1}",
            "actor_rollout_ref.rollout.prompt_length=32", "actor_rollout_ref.rollout.response_length=12",
            "actor_rollout_ref.rollout.agent.num_workers=1", *overrides,
        ])


# ---------------------------------------------------------------------------------- the engine


@dataclass
class SamplingParams:
    """The fields of vLLM 0.33's ``SamplingParams`` (vllm/sampling_params.py:285-446) that verl's
    server sets or replay reads, with vLLM's defaults; ``__post_init__`` normalises greedy
    requests as vLLM does (:615-620)."""

    max_tokens: Optional[int] = 16
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None

    def __post_init__(self):
        if self.temperature < 1e-5:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0


class SampledEngine:
    """Stands in for vLLM's ``AsyncLLM.generate``: request ``i`` samples the scripted tokens ``i``
    from logits where the scripted token leads by 25 nats, with the request's top-k (the
    ``keep_tied`` path when ``ties`` are built in), and streams cumulative ``RequestOutput``s."""

    def __init__(self, scripts, *, ties_at: tuple = (), seed: int = 0):
        # a list: one script per request, in order; a dict: the script of the prompt whose user turn
        # starts with that token (concurrent requests arrive in any order)
        self.scripts, self.ties_at, self.seed = scripts if isinstance(scripts, dict) else list(scripts), set(ties_at), seed
        self.seen: list = []
        self.references: list = []  # per request: the sampler's steps
        self.by_key: dict = {}

    def logits(self, tokens: list, request: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + request)
        z = torch.randn(len(tokens), V, generator=g, dtype=torch.float64) * 2
        for j, t in enumerate(tokens):
            z[j, t] = 25.0
            if j in self.ties_at:  # the k-th and (k+1)-th best tie: the PyTorch path keeps both
                order = [i for i in torch.argsort(z[j], descending=True).tolist() if i != t]
                z[j, order[TOP_K - 1]] = z[j, order[TOP_K - 2]]
        return z

    def generate(self, *, prompt, sampling_params, request_id, lora_request=None, priority=0):
        self.seen.append(sampling_params)
        return self._stream(prompt, sampling_params)

    async def _stream(self, prompt, sp):
        request = len(self.references)
        ids = prompt["prompt_token_ids"]
        key = ids[len(ids) - 1 - ids[::-1].index(T["user"]) + 1] if isinstance(self.scripts, dict) else None
        tokens = (self.scripts[key] if key is not None else self.scripts.pop(0))[: sp.max_tokens]
        z = self.logits(tokens, request)
        num = sp.logprobs or 0
        if sp.temperature < 1e-5:  # greedy: the argmax, its log-prob over the full softmax
            steps = vllm_steps(z, 1.0, top_k=V, num_logprobs=max(num, 1), seed=request)
            for s, t in zip(steps, tokens):
                assert s.token == t
        else:
            ties = "keep_tied" if self.ties_at else "index_order"
            steps = vllm_steps(z, sp.temperature, top_k=sp.top_k if sp.top_k > 0 else V, top_p=sp.top_p,
                               num_logprobs=max(num, 1), ties=ties, seed=request)
        assert [s.token for s in steps] == tokens, "the scripted token leads by 25 nats: the sampler picks it"
        self.references.append(steps)
        self.by_key[key] = steps
        for n in range(1, len(steps) + 1):
            completion = vllm_offline_output(steps[:n], max(num, 1) if num else 0)
            yield RequestOutput("r", None, prompt["prompt_token_ids"], None, [completion], n == len(steps))


class VerlVllmServer:
    """The parts of verl's ``vLLMHttpServer`` replay's mixin touches: ``config`` (``RolloutConfig``),
    ``model_config`` (``HFModelConfig``), ``engine``, ``launch_server``, ``generate``."""

    def __init__(self, config, model_config, engine, *, model_overrides=None):
        self.config = omega_conf_to_dataclass(config)  # vllm_async_server.py:1093-1095
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)  # :1097-1099
        settings = {"logprobs_mode": self.config.logprobs_mode,
                    "max_logprobs": self.config.engine_kwargs["vllm"].get("max_logprobs", 20), **(model_overrides or {})}
        self._engine = engine
        self._engine.vllm_config = SimpleNamespace(model_config=SimpleNamespace(**settings))  # vLLM 0.24: no masks

    async def launch_server(self):
        self.engine = self._engine  # :532

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, priority=0, kv_transfer_params=None):
        max_tokens = sampling_params.pop("max_tokens", self.config.response_length)  # :598-607
        sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None  # :622
        sampling_params.setdefault("repetition_penalty", self.config.get("repetition_penalty", 1.0))  # :623
        sampling_params.setdefault("ignore_eos", self.config.get("ignore_eos", False))  # :624
        sp = SamplingParams(max_tokens=max_tokens, **sampling_params)  # :634
        final = None
        async for output in self.engine.generate(  # :667-673
            prompt={"prompt_token_ids": prompt_ids}, sampling_params=sp, request_id=request_id, lora_request=None,
            priority=priority,
        ):
            final = output
        extra_fields = {"global_steps": 0}  # :689
        token_ids = final.outputs[0].token_ids  # :710
        log_probs = None
        if sp.logprobs is not None:  # :711-713
            log_probs = [lp[token_ids[i]].logprob for i, lp in enumerate(final.outputs[0].logprobs)]
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, routed_experts=None,  # :751-758
                           stop_reason="completed", num_preempted=None, extra_fields=extra_fields)


class ReplayServer(_VllmServerReplay, VerlVllmServer):
    """Replay's server as ``replay_vllm_replica_class`` builds it: the mixin before verl's class."""


class Client:
    """verl's ``LLMServerClient.generate`` (workers/rollout/llm_server.py:99-169) without Ray: the
    server gets a copy of the sampling parameters (a Ray call serialises them), a fresh request
    id per turn (:90-97), and the output's ``min/max_global_steps`` are filled (:164-166)."""

    def __init__(self, server):
        self.server, self.calls = server, 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, **kwargs):
        kwargs.pop("mm_processor_output", None)
        self.calls += 1
        output = await self.server.generate(request_id=f"req-{self.calls}", prompt_ids=list(prompt_ids),
                                            sampling_params=dict(sampling_params), image_data=image_data,
                                            video_data=video_data, **kwargs)
        steps = output.extra_fields.get("global_steps")
        output.extra_fields.setdefault("min_global_steps", steps)
        output.extra_fields.setdefault("max_global_steps", steps)
        return output


def make_server(cfg, engine, **kw) -> ReplayServer:
    server = ReplayServer(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, engine, **kw)
    asyncio.run(server.launch_server())
    return server


def server_rows(output, width: int = TOP_K) -> np.ndarray:
    """The rows a server put into ``TokenOutput.extra_fields``: one uint8 buffer (what crosses Ray), decoded as the
    agent loop checks it (response_rows.turn_rows), decoded and padded here to ``(len(token_ids), width)`` int32."""
    buf = output.extra_fields[SUPPORT_KEY]
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1
    turn_rows(buf, output.token_ids, width, where="test")  # what the agent loop accepts
    return buffer_rows(buf, output.token_ids, width).numpy()


def support_of(step, width: int) -> list:
    """The sampler's support of one step, ordered as the adapter orders rows (ids ascending),
    -1 padded to ``width``."""
    lp = dict(zip(step.token_ids, step.logprobs))
    members = sorted(step.mask) if all(t in lp for t in step.mask) else None
    return members + [PAD_ID] * (width - len(members))


# ---------------------------------------------------------------------------------- the server


def test_vllm_server_records_the_sampled_supports(tiny_model_dir):
    cfg = verl_config(tiny_model_dir)
    script = [T["hello"], T["world"], T["cat"], EOS]
    engine = SampledEngine([script])
    server = make_server(cfg, engine)
    params = dict(temperature=1.0, top_p=1.0, top_k=TOP_K, repetition_penalty=1.0, logprobs=True)  # agent_loop.py:590-596
    output = asyncio.run(server.generate([T["<|im_start|>"], T["user"]], params, "req-1"))

    assert engine.seen[0].logprobs == TOP_K + 1, "verl asks logprobs=0; replay asks top_k + 1 on the same SamplingParams"
    rows = server_rows(output)
    assert rows.dtype == np.int32 and rows.shape == (len(script), TOP_K)
    steps = engine.references[0]
    for j, s in enumerate(steps):
        assert rows[j].tolist() == support_of(s, TOP_K)
        assert script[j] in rows[j].tolist()
        assert sorted(s.mask) == sorted(r for r in rows[j].tolist() if r >= 0)
    # verl's own log-probs (:711-713) are the processed ones: over the support, not the vocabulary
    np.testing.assert_allclose(output.log_probs, [s.logprobs[0] for s in steps], rtol=0, atol=1e-6)
    assert FLAGS_KEY not in output.extra_fields


def test_vllm_server_flags_a_support_wider_than_its_log_prob_list(tiny_model_dir):
    cfg = verl_config(tiny_model_dir)
    script = [T["red"], T["green"], T["blue"]]
    engine = SampledEngine([script], ties_at=(1,))
    output = asyncio.run(make_server(cfg, engine).generate([T["user"]], dict(temperature=1.0, top_p=1.0, top_k=TOP_K), "r"))
    rows = server_rows(output)
    assert len(engine.references[0][1].mask) == TOP_K + 1, "the tie keeps k + 1 members (vLLM's PyTorch path)"
    assert (rows[1] == PAD_ID).all() and output.extra_fields[FLAGS_KEY] == {"not_fully_visible": 1}
    assert rows[0].tolist() == support_of(engine.references[0][0], TOP_K)
    # verl was not asked for log-probs, but the SamplingParams it reads at :711 now ask top_k + 1: its
    # TokenOutput carries the processed log-probs anyway (calculate_log_probs=true is required regardless)
    np.testing.assert_allclose(output.log_probs, [s.logprobs[0] for s in engine.references[0]], rtol=0, atol=1e-6)


def test_vllm_server_with_room_for_the_margin_reads_a_tied_support_whole(tiny_model_dir):
    """vLLM 0.24 / 0.25 keep every token tied with the k-th below 8 rows a step (their PyTorch path,
    topk_topp_sampler.py:345-360, 384-392): with max_logprobs room the request asks past top_k + 1
    and the tied support is kept whole instead of flagged (rows top_k + 16 wide, within max_logprobs - 1)."""
    cfg = verl_config(tiny_model_dir, f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs={TOP_K + 3}")
    script = [T["red"], T["green"], T["blue"]]
    engine = SampledEngine([script], ties_at=(1,))
    output = asyncio.run(make_server(cfg, engine).generate([T["user"]], dict(temperature=1.0, top_p=1.0, top_k=TOP_K), "r"))
    rows = server_rows(output, TOP_K + 2)
    assert engine.seen[0].logprobs == TOP_K + 3 and rows.shape == (len(script), TOP_K + 2)
    assert len(engine.references[0][1].mask) == TOP_K + 1 and FLAGS_KEY not in output.extra_fields
    for j, s in enumerate(engine.references[0]):
        assert rows[j].tolist() == support_of(s, TOP_K + 2)


def test_vllm_server_serves_validation_unrecorded_and_refuses_unrecordable_training(tiny_model_dir):
    cfg = verl_config(tiny_model_dir)
    engine = SampledEngine([[T["yes"], EOS], [T["no"], EOS]])
    server = make_server(cfg, engine)
    greedy = asyncio.run(server.generate([T["user"]], dict(temperature=0, top_p=1.0, top_k=-1, logprobs=True), "v"))
    assert SUPPORT_KEY not in greedy.extra_fields and engine.seen[0].logprobs == 0
    unbounded = asyncio.run(server.generate([T["user"]], dict(temperature=0.7, top_p=0.9, top_k=-1), "v2"))
    assert SUPPORT_KEY not in unbounded.extra_fields, "val_kwargs sampling without top-k: not a training request"

    cfg = verl_config(tiny_model_dir, "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.custom.replay.support_width=8")
    server = make_server(cfg, SampledEngine([[T["yes"]]]))
    with pytest.raises(ValueError, match=r"training settings cannot be recorded"):
        asyncio.run(server.generate([T["user"]], dict(temperature=1.0, top_p=1.0, top_k=-1), "t"))


def test_vllm_server_refuses_an_engine_without_room_for_the_log_probs(tiny_model_dir):
    cfg = verl_config(tiny_model_dir)
    with pytest.raises(ValueError, match=r"max_logprobs=3.*--max-logprobs 5"):
        make_server(cfg, SampledEngine([]), model_overrides={"max_logprobs": 3})
    with pytest.raises(ValueError, match=r"logprobs_mode='raw_logprobs'.*processed_logprobs"):
        make_server(cfg, SampledEngine([]), model_overrides={"logprobs_mode": "raw_logprobs"})


# ---------------------------------------------------------------------------------- SGLang


@dataclass
class GenerateReqInput:
    """SGLang 0.5.23's ``GenerateReqInput`` fields verl sets or replay reads
    (sglang/srt/managers/io_struct.py:177-250)."""

    rid: Optional[str] = None
    input_ids: Optional[list] = None
    sampling_params: Optional[dict] = None
    return_logprob: Optional[bool] = None
    image_data: object = None
    video_data: object = None
    return_sampling_mask: Optional[bool] = None
    sampling_logprobs_mode: Optional[str] = None


@dataclass
class GenerateReqInput0512:
    """SGLang 0.5.12 (verl 0.9.1's pin): the same request without sampling masks."""

    rid: Optional[str] = None
    input_ids: Optional[list] = None
    sampling_params: Optional[dict] = None
    return_logprob: Optional[bool] = None


def test_sglang_recorder_reads_masks_and_the_sampler_log_probs(tiny_model_dir):
    replay = RolloutReplay.from_rollout_config(verl_config(tiny_model_dir).actor_rollout_ref.rollout)
    recorder = SglangSupportRecorder(replay, vocab_size=V)
    SglangSupportRecorder.check_engine(GenerateReqInput)
    with pytest.raises(ValueError, match=r"sglang>=0.5.23.*rollout.name=vllm"):
        SglangSupportRecorder.check_engine(GenerateReqInput0512)

    # async_sglang_server.py:611-633 builds the request from verl's sampling parameters
    request = GenerateReqInput(rid="r", input_ids=[3, 10], return_logprob=True, sampling_params={
        "temperature": 1.0, "top_p": 0.9, "top_k": TOP_K, "repetition_penalty": 1.0, "max_new_tokens": 5})
    body = recorder.prepare(request)
    assert request.return_sampling_mask is True and request.sampling_logprobs_mode == "selected"
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    steps = sglang_steps(logits, 1.0, top_k=TOP_K, top_p=0.9, seed=1)
    # tokenizer_manager.py:2706-2712 (skip_tokenizer_init: output_ids + meta_info)
    response = {"output_ids": [s.token for s in steps], "meta_info": sglang_meta_info(steps, "selected")}
    recorded = recorder.read(response, body)
    for j, s in enumerate(steps):
        assert sorted(recorded[0].row(j).tolist()) == sorted(s.row)  # CSR rows, one a generated token
    # verl's TokenOutput (async_sglang_server.py:661-666, :718-725): full-vocabulary log-probs
    output = TokenOutput(token_ids=response["output_ids"], log_probs=[-9.0] * len(steps), extra_fields={"global_steps": 0})
    attach_support(output, recorded, replace_logprobs=True)
    np.testing.assert_allclose(output.log_probs, [s.selected_logprob for s in steps], rtol=0, atol=1e-6)
    assert server_rows(output).shape == (5, TOP_K)

    greedy = GenerateReqInput(rid="g", sampling_params={"temperature": 0.0, "top_k": 1})
    assert recorder.prepare(greedy) is None and greedy.return_sampling_mask is None


def test_attach_support_refuses_rows_of_another_length():
    output = TokenOutput(token_ids=[5, 6, 7], extra_fields={})
    with pytest.raises(ValueError, match=r"2 support rows for 3 generated tokens"):
        attach_support(output, (RaggedSupport.from_rows([[[5], [6]]]), {}))
    aborted = TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={})
    assert SUPPORT_KEY not in attach_support(aborted, (RaggedSupport.from_rows([[[5], [6]]]), {})).extra_fields


# ---------------------------------------------------------------------------------- agent loops


def prompts_batch(texts: list) -> DataProto:
    """The generation batch verl hands ``AgentLoopWorker.generate_sequences``: ``raw_prompt`` chat
    messages per sample (utils/dataset/rl_dataset.py), ``index``, ``meta_info['global_steps']``
    (trainer/ppo/ray_trainer.py:1489)."""
    raw = np.empty(len(texts), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in texts]
    return DataProto.from_dict(non_tensors={"raw_prompt": raw, "index": np.arange(len(texts))}, meta_info={"global_steps": 1})


def v0_config(model_dir, *overrides):
    return verl_config(model_dir, "trainer.use_v1=false",
                       "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                       "nemo_replay.integrations.verl.agent_loop.ReplayAgentLoopManager", *overrides)


def decoded_rows(column, responses, mask, width: int = TOP_K) -> torch.Tensor:
    """(B, W, width) int32 rows of a batch's compact column, as the engines read it (response_rows.compact_rows)."""
    buffers = buffers_of(column)
    assert all(isinstance(b, np.ndarray) and b.dtype == np.uint8 and b.ndim == 1 for b in buffers)
    lengths = torch.tensor([SampleRows.from_bytes(b).length for b in buffers])  # the agent loops' form
    rows = dense_from_compact(*compact_rows(buffers, responses, lengths, mask != 0, key=SUPPORT_KEY))
    return torch.nn.functional.pad(rows, (0, width - rows.shape[2]), value=PAD_ID)


def test_v0_batch_carries_rows_aligned_with_responses(tiny_model_dir):
    cfg = v0_config(tiny_model_dir)
    scripts = {
        T["hello"]: [T["hello"], T["world"], EOS],
        T["add"]: [T["red"], T["green"], T["blue"], T["cat"], T["dog"], T["yes"], T["no"], T["maybe"], T["ok"], T["add"], T["the"], T["numbers"], T["result"], EOS],
        T["red"]: [T["cat"], T["dog"], T["ok"], EOS],
    }
    engine = SampledEngine(scripts, ties_at=(2,), seed=1)
    worker = ReplayAgentLoopWorker(cfg, Client(make_server(cfg, engine)))
    out = asyncio.run(worker.generate_sequences(prompts_batch(["hello world", "add the numbers", "red green"])))

    responses, mask = out.batch["responses"], out.batch["response_mask"]
    column = out.non_tensor_batch[SUPPORT_KEY]  # one compact buffer a sample (agent_loop.py _postprocess)
    assert column.dtype == object and column.shape == (3,)
    rows = decoded_rows(column, responses, mask)
    R = cfg.actor_rollout_ref.rollout.response_length
    assert rows.shape == (3, R, TOP_K) and responses.shape == (3, R)
    flagged_total = 0
    order = [engine.by_key[T[w]] for w in ("hello", "add", "red")]  # the batch keeps the prompts' order
    for i, steps in enumerate(order):
        n = min(len(steps), R)  # verl cuts the response at response_length (single_turn_agent_loop.py:93-95)
        assert responses[i, :n].tolist() == [s.token for s in steps][:n]
        for j in range(n):
            if len(steps[j].mask) > TOP_K:  # the tie: flagged, out of the loss, row all -1
                assert (rows[i, j] == PAD_ID).all() and mask[i, j] == 0
                flagged_total += 1
            else:
                assert rows[i, j].tolist() == support_of(steps[j], TOP_K) and mask[i, j] == 1
                assert int(responses[i, j]) in rows[i, j].tolist()
        assert (rows[i, n:] == PAD_ID).all() and (mask[i, n:] == 0).all()
    assert flagged_total == 3 and list(out.non_tensor_batch[FLAGGED_KEY]) == [1, 1, 1]
    # the sampler's log-probs ride as rollout_log_probs (agent_loop.py:773-776, zero-padded)
    for i, steps in enumerate(order):
        n = min(len(steps), R)
        np.testing.assert_allclose(out.batch["rollout_log_probs"][i, :n].numpy(), [s.logprobs[0] for s in steps[:n]], atol=1e-6)
    # shards of two workers concatenate (agent_loop.py:1252, DataProto.concat), each buffer with its sample
    both = DataProto.concat([out, out])
    assert both.non_tensor_batch[SUPPORT_KEY].shape == (6,)
    assert torch.equal(decoded_rows(both.non_tensor_batch[SUPPORT_KEY], both.batch["responses"],
                                    both.batch["response_mask"]), torch.cat([rows, rows]))
    # and survive the engines' TensorDict (protocol.py to_tensordict: a NonTensorStack), read as the engine reads it
    resp = read_responses(out.to_tensordict())
    dense = dense_from_compact(resp.rows, resp.row_ids)  # the engine keeps them compact; decoded to compare
    assert torch.equal(torch.nn.functional.pad(dense, (0, TOP_K - dense.shape[2]), value=PAD_ID), rows)


def test_v0_validation_batch_has_padding_rows(tiny_model_dir):
    cfg = v0_config(tiny_model_dir)
    engine = SampledEngine({T["hello"]: [T["yes"], EOS], T["world"]: [T["no"], T["ok"], EOS]})
    worker = ReplayAgentLoopWorker(cfg, Client(make_server(cfg, engine)))
    batch = prompts_batch(["hello", "world"])
    batch.meta_info["validate"] = True  # greedy val_kwargs (trainer/config/rollout/rollout.yaml val_kwargs)
    out = asyncio.run(worker.generate_sequences(batch))
    rows = decoded_rows(out.non_tensor_batch[SUPPORT_KEY], out.batch["responses"], out.batch["response_mask"])
    assert (rows == PAD_ID).all() and out.batch["response_mask"][1, :3].tolist() == [1, 1, 1]


def test_worker_refuses_verl_loop_without_rows(tiny_model_dir):
    cfg = v0_config(tiny_model_dir, "actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent")
    worker = ReplayAgentLoopWorker(cfg, Client(make_server(cfg, SampledEngine([[T["yes"], EOS]]))))
    with pytest.raises(ValueError, match=r"carries no generation_support.*replay_single_turn_agent"):
        asyncio.run(worker.generate_sequences(prompts_batch(["hello"])))


def test_loop_refuses_a_server_that_returns_no_rows_for_training(tiny_model_dir):
    cfg = v0_config(tiny_model_dir)
    plain = VerlVllmServer(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, SampledEngine([[T["yes"], EOS]]))
    asyncio.run(plain.launch_server())
    worker = ReplayAgentLoopWorker(cfg, Client(plain))
    with pytest.raises(ValueError, match=r"returned no support rows for a training request.*VERL_USE_EXTERNAL_MODULES"):
        asyncio.run(worker.generate_sequences(prompts_batch(["hello"])))


TRAIN = dict(temperature=1.0, top_p=1.0, top_k=TOP_K, repetition_penalty=1.0, logprobs=True)  # agent_loop.py:590-596


def run_loop(cfg, name: str, client, prompt: str, **extra):
    """One agent loop built as ``AgentLoopWorker._run_agent_loop`` builds it (agent_loop.py:684-694),
    inside a running event loop as in verl's worker, and run on one chat prompt."""
    import hydra

    register_agent_loops()
    tokenizer = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig).tokenizer

    async def main():
        loop = hydra.utils.instantiate(
            config=_agent_loop_registry[name], trainer_config=DictConfigWrap(config=cfg), server_manager=client,
            tokenizer=tokenizer, processor=None, hf_model_type="llama", dataset_cls=None,
            data_config=DictConfigWrap(cfg.data), **extra,
        )
        return await loop.run(dict(TRAIN), raw_prompt=[{"role": "user", "content": prompt}])

    return asyncio.run(main())


def test_v1_fields_carry_rows_through_list_of_dict_to_tensordict(tiny_model_dir):
    cfg = verl_config(tiny_model_dir)
    scripts = [[T["hello"], T["world"], EOS], [T["red"], T["green"], T["blue"], T["cat"], EOS]]
    engine = SampledEngine(scripts, seed=2)
    client = Client(make_server(cfg, engine))
    outputs = []
    for prompt in ("hello", "add the numbers"):
        outputs.append(run_loop(cfg, "replay_single_turn_agent", client, prompt))
    assert all(isinstance(o, ReplayAgentLoopOutput) for o in outputs)
    fields = []
    for o in outputs:  # trainer/ppo/v1/agent_loop_tq.py:203-215
        f = o.as_dict()
        f.pop("multi_modal_data", None)
        f["loss_mask"] = f["response_mask"]
        fields.append(f)
    td = list_of_dict_to_tensordict(fields)  # agent_loop_tq.py:233-238
    responses = td["responses"].to_padded_tensor(0)
    padded = decoded_rows(td[SUPPORT_KEY], responses, td["response_mask"].to_padded_tensor(0))  # a NonTensorStack
    assert padded.shape == (2, 5, TOP_K) and responses.shape == (2, 5)
    for i, steps in enumerate(engine.references):
        for j, s in enumerate(steps):
            assert padded[i, j].tolist() == support_of(s, TOP_K) and int(responses[i, j]) in padded[i, j].tolist()
        assert (padded[i, len(steps):] == PAD_ID).all()
    assert "extra_fields" in td.keys() and all(SUPPORT_KEY not in e for e in list(td["extra_fields"]))


def calc_tool() -> FunctionTool:
    schema = OpenAIFunctionToolSchema(type="function", function=OpenAIFunctionSchema(name="calc", description="adds"))
    return FunctionTool(name="calc", fn=lambda: "the result is 3", tool_schema=schema)


def test_tool_loop_rows_skip_tool_tokens_across_turns(tiny_model_dir):
    cfg = verl_config(tiny_model_dir, "actor_rollout_ref.rollout.response_length=40",
                      "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2")
    call = ["<tool_call>", "{", '"name"', ":", '"calc"', ",", '"arguments"', ":", "{", "}", "}", "</tool_call>", "<|im_end|>"]
    scripts = [[T[t] for t in call], [T["result"], T["is"], T["3"], EOS]]
    engine = SampledEngine(scripts, ties_at=(1,), seed=3)
    out = run_loop(cfg, "replay_tool_agent", Client(make_server(cfg, engine)), "add the numbers", tools=ToolListWrap([calc_tool()]))
    response, mask = out.response_ids, out.response_mask
    rows = decoded_rows([out.generation_support], torch.tensor([response]), torch.tensor([mask]))[0]
    assert rows.shape == (len(response), TOP_K)
    turn1, turn2 = engine.references
    assert response[: len(turn1)] == [s.token for s in turn1] and response[-len(turn2):] == [s.token for s in turn2]
    tool_span = range(len(turn1), len(response) - len(turn2))
    assert len(tool_span) > 0 and all(mask[j] == 0 and (rows[j] == PAD_ID).all() for j in tool_span)
    for offset, steps in ((0, turn1), (len(response) - len(turn2), turn2)):
        for j, s in enumerate(steps):
            if j == 1:  # the tied position of each turn: flagged, out of the loss
                assert mask[offset + j] == 0 and (rows[offset + j] == PAD_ID).all()
                continue
            assert rows[offset + j].tolist() == support_of(s, TOP_K) and mask[offset + j] == 1
    assert out.extra_fields[FLAGGED_KEY] == 2 and out.extra_fields[FLAGS_KEY] == {"not_fully_visible": 2}


def test_track_refuses_a_row_off_by_one(tiny_model_dir):
    from nemo_replay.integrations.verl.agent_loop import SupportTrack
    from verl.utils.tokenizer.continuous_token import ContinuousTokenBuilder

    replay = RolloutReplay.from_rollout_config(verl_config(tiny_model_dir).actor_rollout_ref.rollout)
    tokenizer = omega_conf_to_dataclass(verl_config(tiny_model_dir).actor_rollout_ref.model, dataclass_type=HFModelConfig).tokenizer
    builder = ContinuousTokenBuilder(tokenizer)
    track = SupportTrack(replay, 12)
    rows = np.array([[5, 6, -1, -1], [7, 8, -1, -1]], dtype=np.int32)
    track.capture(TokenOutput(token_ids=[5, 7], extra_fields={SUPPORT_KEY: encode_response_rows(rows, [5, 7])}), {})
    merge = builder.merge_assistant_tokens([1, 2], [5, 7])
    track.on_assistant(builder, merge, [5, 7], 0)
    rows, mask, flagged = track.finish([7, 5], [1, 1])  # rows are placed, not decoded, here
    assert flagged == 0 and mask == [1, 1] and rows.runs.tolist() == [[0, 0, 2]]
    assert rows.buffers[0] is track.buffers[0]  # the server's buffer as it came: encoded once
    from nemo_replay.integrations.verl.engine import check_replay_batch

    batch = {"responses": torch.tensor([[7, 5]]), "response_mask": torch.tensor([mask]), "prompts": torch.tensor([[1, 2]]),
             "attention_mask": torch.ones(1, 4, dtype=torch.int64), SUPPORT_KEY: [rows.to_bytes()]}
    with pytest.raises(SupportAlignmentError, match=r"sample 0, response position 0: token 7 is not a member"):
        check_replay_batch(batch, vocab_size=100)  # the engine's check of the decoded rows against the tokens
