#!/usr/bin/env bash
# The environment the NeMo-RL integration's tests run in against NeMo-RL's own code (NEMO_RL_SRC, the
# tree at 7ea279a): Python 3.11, CPU torch 2.13.0, this repository editable with its "nemo-rl" extra
# (the packages NeMo-RL's driver-side modules import; setup.py says why it is not in "all") and "dev",
# and the pytest plugins NeMo-RL's own unit tests are written for (its "test" group: pytest-asyncio,
# pytest-timeout) with math-verify, which its data tests import through examples/run_eval.py.
# NeMo-RL itself is not installed: the tests put a patched copy of its tree first on PYTHONPATH.
#
#   bash scripts/nemo_rl_env.sh                 # venv at $NEMO_RL_ENV, default $TMPDIR/nemo-replay-nemo-rl-env
#   NEMO_RL_SRC=../shared/nemo-rl-7ea279a NEMO_RL_PYTHON="$NEMO_RL_ENV/bin/python" \
#       "$NEMO_RL_ENV/bin/python" -m pytest -q tests/integrations/nemo_rl
#   "$NEMO_RL_ENV/bin/python" scripts/nemo_rl_unit_tests.py ../shared/nemo-rl-7ea279a
#
# PYTHON names the interpreter the venv is made from (default python3.11: NeMo-RL targets 3.13, and the
# tests stand typing_extensions' TypedDict in for 3.11's, tests/integrations/nemo_rl/pytest_plugins/nemo_rl_cpu_shims.py).
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir="${NEMO_RL_ENV:-${TMPDIR:-/tmp}/nemo-replay-nemo-rl-env}"
start=$SECONDS
"${PYTHON:-python3.11}" -m venv "$env_dir"
"$env_dir/bin/pip" install --quiet torch==2.13.0 -e ".[nemo-rl,dev]" pytest-asyncio pytest-timeout math-verify
echo "nemo-rl environment at $env_dir ($("$env_dir/bin/python" --version), built in $((SECONDS - start)) s)"
