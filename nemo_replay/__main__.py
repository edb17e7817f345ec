"""``python -m nemo_replay ...`` runs the ``nemo-replay`` command line (see :mod:`nemo_replay.cli`)."""

import sys

from nemo_replay.cli import main

# Guarded: an engine that starts its workers by spawning (vLLM) imports this module again in
# each child, which must not run the command a second time.
if __name__ == "__main__":
    sys.exit(main())
