#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it runs and writes). On the lent GPU machine, in one device call with
# carry=[".whl"] (the wheels scripts/gpu_wheels.sh fetched here) and a timeout of 600 s:
#   bash scripts/gpu_check.sh                # installs the carried wheels into /tmp/site, then runs every part
# Here, on CPU with small models, to prove everything but CUDA itself:
#   bash scripts/gpu_check.sh --dry-run
# The figures land in $OUT/gpu_check.json and the log in $OUT/gpu_check.log ($OUT unset: outputs/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ "${1:-}" != "--dry-run" ]]; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: no wheels in .whl/: run 'bash scripts/gpu_wheels.sh' here first, then carry .whl" >&2
        exit 2
    fi
    # --no-deps: the set is complete as gpu_wheels.sh proved; the first part checks it against what is installed.
    timeout 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "gpu_check: installing the carried wheels failed" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
