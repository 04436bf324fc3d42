#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it runs and writes). On the lent GPU machine, two device calls, each
# with a timeout of 600 s, the second right after the first:
#   1. carry=[".whl"]:             bash scripts/gpu_check.sh                 # every part; the Ray part skipped
#   2. carry=[".whl", ".whl-ray"]: bash scripts/gpu_check.sh --only grpo_ray # the Ray part (and versions)
# Each installs the carried wheels (scripts/gpu_wheels.sh fetched .whl here, `gpu_wheels.sh --ray` also .whl-ray)
# into /tmp/site first. Why two: the parts of the first call are budgeted at 9 minutes, and the Ray part (up to
# 150 s, with its install) would take the call past the 600 s a command may run. Why Ray travels whole in the second:
# ray's wheel (75.6 MiB) is over the 64 MiB a call carries, so gpu_wheels.sh --ray drops its Java jar (ray_dist.jar,
# 30.7 MiB, which a Python-only cluster never loads): .whl, .whl-ray and the repository then send 58 MiB, and the
# second call needs nothing the first left behind. Splitting the wheel over two calls instead would make the second
# depend on the first's files, which survive only while the machine stays warm (30 s after a call). Right after the
# first call (the machine still warm) the second reuses the models it built (in /tmp/gpu_check/models) and its
# gpu_check.json holds the first call's parts beside the Ray part; on a fresh machine it builds them again (up to
# 50 s) and reports its own parts only.
# Here, on CPU with small models, to prove everything but CUDA itself (the Ray worker on a CPU):
#   bash scripts/gpu_check.sh --dry-run
# The figures land in $OUT/gpu_check.json and the log in $OUT/gpu_check.log ($OUT unset: outputs/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ " $* " != *" --dry-run "* ]]; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: no wheels in .whl/: run 'bash scripts/gpu_wheels.sh' here first, then carry .whl" >&2
        exit 2
    fi
    wheels=(.whl/*.whl)
    if ls .whl-ray/*.whl >/dev/null 2>&1; then  # carried by the Ray part's call (gpu_wheels.sh --ray)
        wheels+=(.whl-ray/*.whl)
    fi
    # --no-deps: the set is complete as gpu_wheels.sh proved; the first part checks it against what is installed.
    timeout 90 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" || { echo "gpu_check: installing the carried wheels failed" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
