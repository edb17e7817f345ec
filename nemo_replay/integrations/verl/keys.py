"""Names shared by the rollout and trainer sides of the verl integration (docs/design.md §9.3)."""

SUPPORT_KEY = "generation_support"  # DataProto.batch / TensorDict key
PAD_ID = -1
# (B, R) float, <= 0: the scorer's log support mass of each scored response token, for metrics.py.
LOG_SUPPORT_MASS_KEY = "replay_log_support_mass"
