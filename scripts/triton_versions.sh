#!/usr/bin/env bash
# The fused compact decode's kernels (nemo_replay/support/codec/fused_kernels.py) under every Triton a
# torch release pins, not only the one .ci/run installs: by hand, after a change to the kernels.
#
#   bash scripts/triton_versions.sh                    # every version below, about 10 minutes
#   TRITON_VERSIONS="3.2.0 3.4.0" bash scripts/triton_versions.sh
#
# Pins, from the torch wheels' metadata (Linux x86_64): torch 2.4 -> 3.0.0, 2.5 -> 3.1.0,
# 2.6 -> 3.2.0, 2.7 -> 3.3.1, 2.8 -> 3.4.0, 2.9 -> 3.5.1, 2.10 and 2.11 -> 3.6.0, 2.12 -> 3.7.0.
# For each version: a venv on the main environment (--system-site-packages) under
# TRITON_VERSIONS_ROOT, that Triton, then tests/support/test_fused_decode.py:
#   compile       both kernels to sm_80 and sm_90 cubins with that Triton's compiler (every version)
#   interpreter   the kernels under that Triton's interpreter against the reference decode, on
#                 clean and corrupted batches; skipped where the interpreter itself is broken:
#                 3.0 and 3.1 write nothing back to torch 2.13's tensors, 3.2 ignores the mask of
#                 a scalar store (docs/transport.md shows both on kernels of a few lines).
# Triton up to 3.6 turns 1-element arrays into ints in its interpreter, which numpy 2.4 refuses: those
# venvs take numpy<2.4. On a GPU the kernels are compiled, and CompactRows.decode checks them on the
# device before they serve (codec.fused.known_batch_passes), whatever this script found.
set -uo pipefail
cd "$(dirname "$0")/.."
root=${TRITON_VERSIONS_ROOT:-${TMPDIR:-/tmp}/nemo-replay-triton-versions}
versions=${TRITON_VERSIONS:-"3.0.0 3.1.0 3.2.0 3.3.1 3.4.0 3.5.1 3.6.0 3.7.1 3.8.0 3.9.0"}
failed=0
summary=""
for v in $versions; do
    env="$root/$v"
    [ -x "$env/bin/python" ] || python -m venv --system-site-packages "$env"
    extra=""
    case "$v" in 3.[0-6].*) extra="numpy<2.4" ;; esac
    if ! "$env/bin/pip" install -q "triton==$v" $extra; then
        summary+="$v: install failed"$'\n'; failed=1; continue
    fi
    case "$v" in 3.0.*|3.1.*|3.2.*) select="compile"; what="compile" ;; *) select=""; what="compile + interpreter" ;; esac
    log="$root/$v.log"
    if NEMO_REPLAY_REQUIRE_TRITON=1 "$env/bin/python" -m pytest -q -p no:cacheprovider \
            tests/support/test_fused_decode.py ${select:+-k "$select"} > "$log" 2>&1; then
        summary+="$v ($what): $(tail -n 1 "$log")"$'\n'
    else
        summary+="$v ($what): FAILED, $log"$'\n'; failed=1
    fi
done
printf '%s' "$summary"
exit $failed
