"""``nemo-replay`` with megatron-core on CPU: the test shims, then the real command line.

    python -m tests.trainer.megatron_cli train replay.strategy=megatron ...
    torchrun --nproc-per-node 2 -m tests.trainer.megatron_cli train replay.strategy=megatron parallel.tensor=2 ...

The shims (tests/strategies/megatron/cpu_shims.py) stay in tests/; everything else -- the signal
handling, the checkpoint writer and its helper processes -- is the package's own.
"""

import sys

if __name__ == "__main__":
    from tests.strategies.megatron.cpu_shims import install_cpu_shims, install_moe_without_te_shim

    install_cpu_shims()
    install_moe_without_te_shim()
    from nemo_replay.cli import main

    sys.exit(main())
