"""nemo_replay.scoring"""
