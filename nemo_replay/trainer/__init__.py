"""nemo_replay.trainer"""
