#!/usr/bin/env bash
# The GPU check, one command: on a CUDA machine, install the pinned SGLang, then run
#   1. the SGLang protocol tests against a real SGLang server (tests/test_sglang_protocol.py,
#      the same tests that run against the strict embedded server on every CI run), and
#   2. a 10-step GRPO run of a small model on SGLang servers with an FSDP2 trainer over NCCL.
#
#   bash ci/gpu.sh /path/to/hf/model [/path/to/train.jsonl]
#
# The model must be a local Hugging Face directory (Qwen2.5-0.5B-Instruct, say). Without a
# GPU it says so and exits 0, so that it can sit in any pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "[gpu] no CUDA device here (nvidia-smi finds none): skipping the GPU check"
    exit 0
fi
MODEL=${1:?usage: bash ci/gpu.sh MODEL_DIR [TRAIN_JSONL]}
PY=${PYTHON:-python3}
n_gpus=$(nvidia-smi -L | wc -l)
echo "[gpu] $n_gpus GPU(s); installing arealite[test,sglang]"
EXTRAS=test,sglang bash ci/setup.sh

echo "[gpu] 1/2 protocol tests against a real SGLang server ($MODEL)"
AREALITE_SGLANG_MODEL="$MODEL" $PY -m pytest -q -rs tests/test_sglang_protocol.py -k sglang

echo "[gpu] 2/2 a 10-step GRPO run on SGLang (1 server GPU + 1 trainer GPU)"
if [ "$n_gpus" -lt 2 ]; then
    echo "[gpu] needs 2 GPUs (a server and a trainer never share one); skipping the run"
    exit 0
fi
OUT=$(mktemp -d)
DATA=${2:-}
if [ -z "$DATA" ]; then
    DATA="$OUT/train.jsonl"
    $PY - "$DATA" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for i in range(256):
        a, b = rng.randrange(100), rng.randrange(100)
        f.write(json.dumps({"prompt": f"What is {a} + {b}? Answer with the number only.",
                            "answer": str(a + b)}) + "\n")
PY
fi
$PY -m arealite.train --config examples/configs/default.yaml \
    actor.model_path="$MODEL" data.train_path="$DATA" data.eval_path=null \
    data.reward_fn=arealite.reward.math:math_reward data.max_train_steps=10 evaluation.max_prompts=null evaluation.freq_steps=null \
    launch.server_backend=sglang launch.n_servers=1 launch.n_trainer_procs=1 \
    server.dtype=bfloat16 weight_sync.method=distributed weight_sync.backend=nccl \
    experiment.output_root="$OUT" experiment.name=gpu-check
echo "[gpu] done: logs, stats and the reward curve are under $OUT"
