#!/usr/bin/env bash
# The wheels that scripts/gpu_check.sh installs on the lent GPU machine, downloaded here into .whl/ (git-ignored).
#
# That machine has no network and no package index. It holds Python 3.12 with torch, transformers, accelerate, peft,
# safetensors, pyarrow, pandas and most of the scientific stack (the device tool's KINDS.md lists them), but none of
# torchrl, tensordict, trl, datasets, hydra-core or omegaconf. This script fetches those, pinned to the versions this
# project is tested with, plus each of their requirements the machine lacks, for CPython 3.12 on manylinux x86_64,
# then proves the set complete: pip resolves the project's packages offline from these wheels and from stand-ins for
# what the machine already holds, and nothing is missing. It prints the set's size (one device call carries at most
# 64 MiB of working tree).
#
#   bash scripts/gpu_wheels.sh            # then: run `bash scripts/gpu_check.sh` there with carry=[".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
PYTHON=${PYTHON:-python}

# What the machine lacks, pinned: the project's own requirements, then theirs that the machine does not hold.
CARRIED=(
    torchrl==0.14.1 tensordict==0.14.3 trl==1.16.0 datasets==5.2.0 hydra-core==1.3.8 omegaconf==2.3.1
    hoptorch==0.1.4 pyvers==0.2.3 orjson==3.13.0 importlib_metadata==10.2.0 lazy-importer==0.1.0
    dill==0.4.1 multiprocess==0.70.19
)
# antlr4-python3-runtime (omegaconf's parser) is published as source only: built here into a pure-Python wheel.
SOURCE_ONLY=(antlr4-python3-runtime==4.9.3)
# What the machine holds and the carried wheels require, as the device tool's notes read them (versions where they
# were read there; the others at this machine's version, checked on the machine itself by gpu_check's first part).
HELD=(
    torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 huggingface-hub==1.33.0 numpy==2.5.2 safetensors==0.8.0
    tokenizers==0.23.2
    peft pyarrow pandas filelock fsspec packaging pyyaml requests httpx tqdm xxhash cloudpickle zipp jinja2 psutil
)
PLATFORM=(
    --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)

mkdir -p "$WHEELS"
"$PYTHON" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$WHEELS" "${CARRIED[@]}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary=:all: -d "$scratch/source" "${SOURCE_ONLY[@]}"
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$scratch"/source/*

# One version of each package: two would stop the install there.
duplicates=$(ls "$WHEELS"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
if [[ -n "$duplicates" ]]; then
    echo "gpu_wheels: $WHEELS holds several versions of: $duplicates; delete $WHEELS and run this again." >&2
    exit 1
fi

# Stand-ins for what the machine holds: empty wheels carrying only a name and a version, so that pip's resolver
# checks the carried set against them offline without downloading multi-GB builds.
"$PYTHON" - "$scratch/held" "${HELD[@]}" <<'EOF'
import importlib.metadata
import sys
import zipfile
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True)
for spec in sys.argv[2:]:
    name, _, version = spec.partition("==")
    version = version or importlib.metadata.version(name)
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(out / f"{dist}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
EOF

# The proof: the project's packages resolve offline, for Python 3.12, from the carried wheels and the stand-ins.
"$PYTHON" -m pip install --quiet --dry-run --no-index --find-links "$WHEELS" --find-links "$scratch/held" \
    "${PLATFORM[@]}" --target "$scratch/target" --report "$scratch/report.json" \
    "${CARRIED[@]%%==*}" "${SOURCE_ONLY[@]%%==*}" peft transformers accelerate safetensors
"$PYTHON" - "$scratch/report.json" "$WHEELS" <<'EOF'
import json
import sys
from pathlib import Path

report = json.loads(Path(sys.argv[1]).read_text())
carried = {path.name for path in Path(sys.argv[2]).glob("*.whl")}
used = {Path(item["download_info"]["url"]).name for item in report["install"]}
unused = sorted(carried - used)
if unused:
    sys.exit(f"gpu_wheels: carried but required by nothing: {unused}")
print(f"gpu_wheels: resolved for CPython 3.12 with nothing missing: {len(carried)} carried wheels, "
      f"{len(used) - len(carried)} packages the machine holds")
EOF
total=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: $(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS, $((total / 1024)) KiB in all (a device call carries at most 64 MiB)"
