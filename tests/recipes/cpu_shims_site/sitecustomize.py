"""megatron-core on CPU inside a Slurm job: the test shims, before ``nemo_replay.cli`` is imported.

The Slurm tests submit the launcher's own batch script unchanged, so its task runs
``-m nemo_replay`` rather than ``tests.trainer.megatron_cli``. With this folder and the
repository on ``PYTHONPATH`` (``sbatch`` passes the environment to the job), every worker
installs the shims of tests/strategies/megatron/cpu_shims.py just before the command line
is imported; processes that never import it (torchrun's agent, checkpoint helpers) are left
as they are. Test-only: the package never sees this folder.
"""

import importlib.abc
import sys


class _ShimsBeforeCli(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "nemo_replay.cli":
            sys.meta_path.remove(self)
            from tests.strategies.megatron.cpu_shims import install_cpu_shims, install_moe_without_te_shim

            install_cpu_shims()
            install_moe_without_te_shim()
        return None  # the normal finders import the module


sys.meta_path.insert(0, _ShimsBeforeCli())
