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
# --ray also fetches Ray, for the check's Ray part, into .whl-ray/ (git-ignored): ray 2.60.0 and the requirements the
# machine lacks (jsonschema and its own), proven with the rest. Ray's wheel is 79.3 MB (75.6 MiB), over what one call
# carries; 30.7 MiB of it is ray/jars/ray_dist.jar, the Java workers' runtime, which a Python-only cluster never loads.
# The wheel is carried without it (`zip -d`; pip installs it as it is, its RECORD listing a file the wheel no longer
# holds): 47.1 MB, so that .whl, .whl-ray and this repository together stay under 64 MiB and the Ray part's call
# needs nothing an earlier call left on the machine. The script prints that call's total.
#
#   bash scripts/gpu_wheels.sh            # then: run `bash scripts/gpu_check.sh` there with carry=[".whl"]
#   bash scripts/gpu_wheels.sh --ray      # then also: `bash scripts/gpu_check.sh --only grpo_ray`, carry=[".whl", ".whl-ray"]
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
RAY_WHEELS=.whl-ray
PYTHON=${PYTHON:-python}
case "${1:-}" in
    "") RAY=false ;;
    --ray) RAY=true ;;
    *) echo "usage: bash scripts/gpu_wheels.sh [--ray]" >&2; exit 2 ;;
esac

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
# --ray: Ray as this project is tested with it, its requirements the machine lacks, and those it holds.
RAY_CARRIED=(
    ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
RAY_HELD=(click msgpack protobuf attrs typing-extensions)
if ! $RAY; then
    RAY_CARRIED=()
    RAY_HELD=()
fi
PLATFORM=(
    --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)

mkdir -p "$WHEELS"
"$PYTHON" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$WHEELS" "${CARRIED[@]}"
FOLDERS=("$WHEELS")
if $RAY; then
    command -v zip >/dev/null || { echo "gpu_wheels: --ray needs zip (apt-get install zip)" >&2; exit 1; }
    mkdir -p "$RAY_WHEELS"
    "$PYTHON" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$RAY_WHEELS" "${RAY_CARRIED[@]}"
    ray_wheel=$(ls "$RAY_WHEELS"/ray-*.whl)
    # pip download fetches the whole wheel again each time (its hash differs from the slim one): slim it again.
    if unzip -l "$ray_wheel" 'ray/jars/*' >/dev/null 2>&1; then
        zip -q -d "$ray_wheel" 'ray/jars/*'
    fi
    FOLDERS+=("$RAY_WHEELS")
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary=:all: -d "$scratch/source" "${SOURCE_ONLY[@]}"
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$scratch"/source/*

# One version of each package: two would stop the install there.
for folder in "${FOLDERS[@]}"; do
    duplicates=$(ls "$folder"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
    if [[ -n "$duplicates" ]]; then
        echo "gpu_wheels: $folder holds several versions of: $duplicates; delete $folder and run this again." >&2
        exit 1
    fi
done

# Stand-ins for what the machine holds: empty wheels carrying only a name and a version, so that pip's resolver
# checks the carried set against them offline without downloading multi-GB builds.
"$PYTHON" - "$scratch/held" "${HELD[@]}" "${RAY_HELD[@]}" <<'EOF'
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
links=()
for folder in "${FOLDERS[@]}" "$scratch/held"; do links+=(--find-links "$folder"); done
"$PYTHON" -m pip install --quiet --dry-run --no-index "${links[@]}" \
    "${PLATFORM[@]}" --target "$scratch/target" --report "$scratch/report.json" \
    "${CARRIED[@]%%==*}" "${SOURCE_ONLY[@]%%==*}" "${RAY_CARRIED[@]%%==*}" peft transformers accelerate safetensors
"$PYTHON" - "$scratch/report.json" "${FOLDERS[@]}" <<'EOF'
import json
import sys
from pathlib import Path

report = json.loads(Path(sys.argv[1]).read_text())
carried = {path.name for folder in sys.argv[2:] for path in Path(folder).glob("*.whl")}
used = {Path(item["download_info"]["url"]).name for item in report["install"]}
unused = sorted(carried - used)
if unused:
    sys.exit(f"gpu_wheels: carried but required by nothing: {unused}")
print(f"gpu_wheels: resolved for CPython 3.12 with nothing missing: {len(carried)} carried wheels, "
      f"{len(used) - len(carried)} packages the machine holds")
EOF
for folder in "${FOLDERS[@]}"; do
    total=$(du -cb "$folder"/*.whl | tail -1 | cut -f1)
    echo "gpu_wheels: $(ls "$folder"/*.whl | wc -l) wheels in $folder, $((total / 1024)) KiB in all"
done
# What a call carrying these folders sends: the repository's tracked and untracked-but-not-ignored files, and them.
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
wheels=$(find "${FOLDERS[@]}" -name '*.whl' -print0 | du -cb --files0-from=- | tail -1 | cut -f1)
call=$((tree + wheels))
echo "gpu_wheels: a call carrying ${FOLDERS[*]} sends $((call / 1048576)) MiB (the repository $((tree / 1048576)) MiB)" \
    "of the 64 MiB it may"
if ((call > 64 * 1048576)); then
    echo "gpu_wheels: that is over 64 MiB: the call would be refused. Make the repository's working tree smaller" \
        "(untracked files count unless git ignores them)." >&2
    exit 1
fi
