"""nemo_replay.layout"""
