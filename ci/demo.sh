#!/usr/bin/env bash
# The main job: set up a fresh CPU machine and run the asynchronous GRPO demo end to end.
#   bash ci/demo.sh [key=value config overrides...]
# DEMO=tool_use runs the tool-use demo instead (what ci/tool_demo.sh does); DEMO=lora the
# reverse-digits demo training LoRA adapters (rank 16) instead of every weight; DEMO=moe the
# reverse-digits demo on a tiny Qwen3-MoE (8 experts, top-2) with routing replay (R3).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash ci/setup.sh
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEMO=${DEMO:-reverse_digits}
EXTRA=()
PREPARE=()
case "$DEMO" in
    reverse_digits) DEMO_DIR=${DEMO_DIR:-runs/demo} ;;
    tool_use) DEMO_DIR=${DEMO_DIR:-runs/tool_demo} ;;
    # LoRA trains ~10x fewer parameters, each with a ~20x larger step; 1.5e-3 and up diverged.
    lora) DEMO=reverse_digits; DEMO_DIR=${DEMO_DIR:-runs/demo}
          EXTRA=(experiment.name=reverse_digits_lora actor.lora.rank=16 actor.lora.alpha=32
                 actor.optimizer.lr=1e-3 data.max_train_steps=120) ;;
    moe) DEMO=reverse_digits; DEMO_DIR=${DEMO_DIR:-runs/demo_moe}; PREPARE=(--size moe-small)
         EXTRA=(experiment.name=reverse_digits_moe algorithm.routing_replay=r3) ;;
    *) echo "DEMO=$DEMO: no such demo (reverse_digits, tool_use, lora or moe)" >&2; exit 2 ;;
esac
python3 "examples/$DEMO/prepare.py" --out "$DEMO_DIR" "${PREPARE[@]}"
export PYTHONPATH="$PWD/examples${PYTHONPATH:+:$PYTHONPATH}"   # workflows and agents named module:function
# A fresh trial each time unless the caller names one (re-using a name resumes it).
TRIAL=${TRIAL:-demo-$(date +%Y%m%d-%H%M%S)}
exec python3 -m arealite.train --config "examples/$DEMO/config.yaml" \
    experiment.trial="$TRIAL" actor.model_path="$DEMO_DIR/model" \
    data.train_path="$DEMO_DIR/train.jsonl" data.eval_path="$DEMO_DIR/eval.jsonl" "${EXTRA[@]}" "$@"
