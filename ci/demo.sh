#!/usr/bin/env bash
# The main job: set up a fresh CPU machine and run the asynchronous GRPO demo end to end.
#   bash ci/demo.sh [key=value config overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash ci/setup.sh
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEMO_DIR=${DEMO_DIR:-runs/demo}
python3 examples/reverse_digits/prepare.py --out "$DEMO_DIR"
# A fresh trial each time unless the caller names one (re-using a name resumes it).
TRIAL=${TRIAL:-demo-$(date +%Y%m%d-%H%M%S)}
exec python3 -m arealite.train --config examples/reverse_digits/config.yaml \
    experiment.trial="$TRIAL" actor.model_path="$DEMO_DIR/model" \
    data.train_path="$DEMO_DIR/train.jsonl" data.eval_path="$DEMO_DIR/eval.jsonl" "$@"
