#!/usr/bin/env bash
# Install arealite and its test dependencies on a fresh CPU machine.
# torch comes first, pinned to the release whose CPU wheel the machine provides,
# so that nothing pulls the CUDA build (gigabytes) as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU wheel)"
    $PY -m pip install -q "torch==2.13.0"
fi
echo "[setup] installing arealite[${EXTRAS:-test}]"
$PY -m pip install -q -e ".[${EXTRAS:-test}]"
