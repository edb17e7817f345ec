"""nemo_replay.rollout"""
