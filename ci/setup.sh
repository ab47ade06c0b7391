#!/usr/bin/env bash
# Install arealite and its test dependencies on a fresh CPU machine.
# torch comes first, pinned to the release whose CPU wheel the machine provides,
# so that nothing pulls the CUDA build (gigabytes) as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    # Ask pip first what it would install: where the default index only has the
    # CUDA build (nvidia-* dependencies) and there is no GPU, take PyTorch's CPU index.
    TORCH_INDEX=()
    report=$(mktemp)
    if $PY -m pip install -q --dry-run --ignore-installed --report "$report" "torch==2.13.0" 2>/dev/null \
        && grep -q '"name": "nvidia-' "$report" && ! command -v nvidia-smi >/dev/null; then
        TORCH_INDEX=(--index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
    fi
    rm -f "$report"
    echo "[setup] installing torch==2.13.0 (CPU wheel) ${TORCH_INDEX[*]:-}"
    $PY -m pip install -q "${TORCH_INDEX[@]}" "torch==2.13.0"
fi
echo "[setup] installing arealite[${EXTRAS:-test}]"
$PY -m pip install -q -e ".[${EXTRAS:-test}]"
