"""nemo_replay.strategies"""
