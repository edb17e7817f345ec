"""Replay inside NeMo-RL: its Megatron and DTensor policy workers, its losses, its batches.

NeMo-RL (github NVIDIA-NeMo/RL) needs Python >= 3.13 and is not a dependency: this package
imports without it and follows its conventions as of the commit in :data:`NEMO_RL_COMMIT`
(right padding, temperature-divided vocab-parallel logits, CP chunks r and 2 cp - 1 - r,
per-sequence packing; :mod:`.layout`). The pieces:

- :func:`replay_prepare_fn` -- a ``prepare_fn`` for the Megatron ``LossPostProcessor``:
  ``next_token_logprobs`` over the recorded supports read from ``data["generation_support"]``
  (one compact :class:`~nemo_replay.support.rows.SampleRows` a sample); NeMo-RL's own loss
  (``ClippedPGLossFn``...) runs on them unchanged;
- :class:`ReplayLogprobsPostProcessor` (Megatron) and :class:`ReplayAutomodelLogprobsPostProcessor`
  (DTensor v2) for the old-policy and reference log-probs, same support (full vocabulary
  selectable, :func:`reference_pass`); :class:`ReplayAutomodelLossPostProcessor` for the
  DTensor policy loss;
- :func:`vllm_support_request` and :func:`completion_supports` for the vLLM worker (each
  completion's CSR rows, encoded once into its sample's rows);
- :func:`check_nemo_rl_recipe` for the recipe options replay depends on;
- :mod:`.workers`: replay's vLLM generation worker and the policy worker extensions that
  install the post-processors in each worker process;
- :func:`install_data_path` (:mod:`.datapath`): ``generation_support`` carried through the
  driver's message logs and batches, one entry a sample;
- :mod:`.patch`: the one source patch (the rollout's per-message slicing) and the command
  that applies it;
- :mod:`.run_grpo`: the launcher, ``examples/run_grpo.py``'s command line with all of it wired.

The recipe overlays are in ``configs/nemo_rl/``; a NeMo-RL user's path from a checkout to a
running job is in the README; the contract is docs/design.md §9.
"""

from nemo_replay.integrations.nemo_rl.hooks import (
    ReplayAutomodelLogprobsPostProcessor,
    ReplayAutomodelLossPostProcessor,
    ReplayLogprobsPostProcessor,
    ReplayLossPostProcessor,
    make_replay_prepare_fn,
    reference_pass,
    replay_prepare_fn,
)
from nemo_replay.integrations.nemo_rl.datapath import backfill_support, carry_support, install_data_path, with_support_pad
from nemo_replay.integrations.nemo_rl.token_aligned import NEMO_RL_COMMIT
from nemo_replay.integrations.nemo_rl.recipe import check_nemo_rl_recipe
from nemo_replay.integrations.nemo_rl.rollout import completion_supports, vllm_support_request
from nemo_replay.integrations.nemo_rl.scoring import SUPPORT_KEY, ReplayScores, next_token_logprobs

__all__ = [
    "NEMO_RL_COMMIT",
    "SUPPORT_KEY",
    "ReplayScores",
    "next_token_logprobs",
    "replay_prepare_fn",
    "make_replay_prepare_fn",
    "reference_pass",
    "ReplayLossPostProcessor",
    "ReplayLogprobsPostProcessor",
    "ReplayAutomodelLossPostProcessor",
    "ReplayAutomodelLogprobsPostProcessor",
    "completion_supports",
    "vllm_support_request",
    "check_nemo_rl_recipe",
    "install_data_path",
    "backfill_support",
    "carry_support",
    "with_support_pad",
    "apply_patch",
    "patch_state",
]


def __getattr__(name: str):
    # The patch module is also a command (``python -m ...nemo_rl.patch``): imported here eagerly,
    # runpy would warn that it was in sys.modules before it ran.
    if name in ("apply_patch", "patch_state"):
        from nemo_replay.integrations.nemo_rl import patch

        return getattr(patch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
