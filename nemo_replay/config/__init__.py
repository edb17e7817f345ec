"""nemo_replay.config"""
