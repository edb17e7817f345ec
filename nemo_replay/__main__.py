"""``python -m nemo_replay ...`` runs the ``nemo-replay`` command line (see :mod:`nemo_replay.cli`)."""

import sys

from nemo_replay.cli import main

sys.exit(main())
