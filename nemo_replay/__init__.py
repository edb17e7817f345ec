"""nemo_replay: support-conditioned log-prob replay for RL trainers.

Importing the package is cheap: it never imports megatron-core or transformers. Strategies
load on first lookup (:func:`get_strategy`).

``nemo_replay.capture`` is the rollout sampler's short name (it re-exports
:mod:`nemo_replay.rollout.capture.sampler`), so ``nemo_replay.capture.sample`` and
``from nemo_replay.capture import sample`` both work.
"""

from nemo_replay import capture
from nemo_replay.scoring.entry import ScorerChannels, score_positions
from nemo_replay.scoring.scorer import SupportScores, score_aligned_support, score_full_vocabulary
from nemo_replay.scoring.shard import VocabShard
from nemo_replay.strategies.registry import (
    StrategySpec,
    available_strategies,
    get_strategy,
    register_strategy,
)
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__version__ = "0.1.0"

__all__ = [
    "capture",
    "PackedTensor",
    "RaggedSupport",
    "SupportScores",
    "SupportAlignmentError",
    "VocabShard",
    "ScorerChannels",
    "score_positions",
    "score_aligned_support",
    "score_full_vocabulary",
    "StrategySpec",
    "register_strategy",
    "get_strategy",
    "available_strategies",
]
