#!/usr/bin/env bash
# Downloads here the wheels experiments/gpu/check.sh installs offline on the lent GPU box.
#
#   bash tools/gpu_wheelhouse.sh [DIR]        # default .whl/gpu (git-ignored; carried by the
#                                             # device tool: run(..., carry=[".whl/gpu"]))
#
# That box has jax[cuda], torch and transformers (and their dependencies: numpy, scipy,
# ml_dtypes, PyYAML, packaging, safetensors, filelock, typing_extensions, ...) and no package
# registry. What the check imports beyond them (bat_jax.model / train / grpo / memory_plan /
# run_programs, configs/, the tests' model fixtures) is the list below: all pure Python, so one
# wheel serves every Python version. Each is downloaded with --no-deps at the version this repo
# pins (requirements*.txt) or the one its venv resolved; msgpack (flax.serialization imports
# it) has only binary wheels, so its pure-Python fallback is built from the sdist. Fails when a
# wheel is not pure Python or the folder exceeds the device tool's 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl/gpu}
PY=${PYTHON:-python3}
LIMIT_MIB=${WHEELHOUSE_LIMIT_MIB:-60}   # under the tool's 64 MiB, leaving room for the tree
# Module the check imports = distribution==version (kept in step with requirements*.txt).
WHEELS=(
  flax==0.12.8 optax==0.2.8 absl-py==2.5.1 ml_collections==1.1.0
  treescope==0.1.10 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  etils==1.15.0 cloudpickle==3.1.3
  pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0
)
MSGPACK=msgpack==1.2.4

rm -rf "$DIR"
mkdir -p "$DIR"
# Pure wheels only, whatever Python runs this; 3.11 is the oldest our pins (and jax) support.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation py --abi none \
    --platform any --python-version 3.11 --dest "$DIR" "${WHEELS[@]}"
# The pure-Python msgpack (its C extension skipped): a py3-none-any wheel.
MSGPACK_PUREPYTHON=1 "$PY" -m pip wheel --quiet --no-deps --no-binary=msgpack --wheel-dir "$DIR" \
    "$MSGPACK"

bad=$(ls "$DIR" | grep -v -- '-py3-none-any\.whl$\|-py2\.py3-none-any\.whl$' || true)
if [[ -n "$bad" ]]; then
  echo "not pure-Python wheels (the box's Python version is unknown): $bad" >&2
  exit 1
fi
size_kib=$(du -sk "$DIR" | cut -f1)
echo "$(ls "$DIR" | wc -l) wheels in $DIR: $((size_kib / 1024)).$(( (size_kib % 1024) * 10 / 1024 )) MiB"
ls "$DIR"
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "wheelhouse is ${size_kib} KiB, over the ${LIMIT_MIB} MiB carry budget" >&2
  exit 1
fi
