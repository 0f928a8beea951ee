#!/usr/bin/env bash
# Dry-run resolution of both GPU environments against the package index (nothing is installed):
#   .venv         trainer:        requirements-cuda12.txt (+ requirements-dev.txt for the tests)
#   .venv-sglang  rollout server: requirements-sglang.txt (pinned sglang and its own pins)
# pip runs --isolated (no site/user pip.conf, no PIP_* variables): the answer is what PyPI gives
# a fresh GPU host. Needs network access to PyPI; not run in CI. Exit status: 0 when both resolve.
#   bash tools/check_gpu_requirements.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
status=0
check() {  # name, requirement args...
  local name="$1"; shift
  echo "== $name: pip install --dry-run --ignore-installed $*"
  local log
  log="$(mktemp)"
  if "$PY" -m pip --isolated install --dry-run --ignore-installed --quiet --report - "$@" >"$log" 2>&1 \
      || { "$PY" -m pip --isolated install --dry-run --ignore-installed "$@" 2>&1 | tail -n 15; false; }; then
    "$PY" - "$log" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
report = json.loads(text[text.index("{"):])
pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
keys = ["jax", "jaxlib", "jax-cuda12-plugin", "sglang", "torch", "transformers", "tokenizers"]
print(f"   resolved {len(pins)} packages: " + ", ".join(f"{k}=={pins[k]}" for k in keys if k in pins))
PY
    echo "   OK"
  else
    echo "   FAILED: $name does not resolve"
    status=1
  fi
  rm -f "$log"
}
check trainer -r requirements-cuda12.txt -r requirements-dev.txt
check rollout-server -r requirements-sglang.txt
exit $status
