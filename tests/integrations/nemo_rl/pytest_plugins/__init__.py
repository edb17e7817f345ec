"""pytest plugins for NeMo-RL's own unit tests, loaded by scripts/nemo_rl_unit_tests.py.

NeMo-RL's tests are a ``tests`` package too, so there these modules are imported by their own
names (``-p nemo_rl_cpu_shims -p nemo_replay_plug``, this folder on ``PYTHONPATH``), never as
``tests.integrations...``; each imports nothing of this repository's ``tests``.
"""
