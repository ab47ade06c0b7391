#!/usr/bin/env bash
# The tool-use demo: a tiny model learns, by RL through the OpenAI-compatible endpoint, to call
# a calculator tool instead of guessing products of 4-digit numbers.
#   bash ci/tool_demo.sh [key=value config overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash ci/setup.sh
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEMO_DIR=${DEMO_DIR:-runs/tool_demo}
python3 examples/tool_use/prepare.py --out "$DEMO_DIR"
export PYTHONPATH="$PWD/examples${PYTHONPATH:+:$PYTHONPATH}"   # the agent: tool_use.agent:run
TRIAL=${TRIAL:-demo-$(date +%Y%m%d-%H%M%S)}
exec python3 -m arealite.train --config examples/tool_use/config.yaml \
    experiment.trial="$TRIAL" actor.model_path="$DEMO_DIR/model" \
    data.train_path="$DEMO_DIR/train.jsonl" data.eval_path="$DEMO_DIR/eval.jsonl" "$@"
