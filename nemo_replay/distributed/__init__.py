"""nemo_replay.distributed: process groups (``groups.py``: a group's size and rank, its ranks
failing together) and torch.distributed's names across torch versions (``compat.py``)."""
