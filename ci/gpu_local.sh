#!/usr/bin/env bash
# The one-GPU check that needs no SGLang (and no internet): on a CUDA machine,
#   1. the FSDP2 engine's CUDA path (bf16 compute, fp32 reduction and master weights), and the
#      packed-attention kernels (varlen, flex) against SDPA run on each sequence alone, and the
#      parallel layout's world mesh and named views on the one GPU (NCCL): Ulysses and tensor
#      parallelism over 1-rank views against the plain modules, a step of the engine,
#   2. the embedded server generating on the GPU, checked token by token against an HF forward,
#   3. a 20-step asynchronous GRPO run of the demo with the trainer and the embedded server on
#      one GPU (weights by shm), its log-prob probe agreeing every step,
#   4. training MFU and tokens/s of a randomly initialised Qwen2.5-1.5B-shaped model (bf16,
#      long-tailed packed RL batches) against transformers' padded SDPA loop
#      (benchmarks/bench_mfu.py), whatever the tests said,
#   5. the planner's trainer memory against torch.cuda.max_memory_allocated for the same
#      1.5B-shaped model (checkpointing off and on, two lengths each; goal within 10%), and a
#      length it predicts over the card really running out of memory (benchmarks/bench_plan_gpu.py),
#   6. FP8 rollout: the embedded server's FP8 tensor-core matmul (torch.nn.functional.scaled_mm, 1x128/128x128
#      block scales) against the de-quantised one, and decode tokens/s of a randomly initialised
#      1.5B-shaped model with FP8 linear layers against bf16, plus the time to produce a push's
#      FP8 buckets against bf16 ones (benchmarks/bench_fp8.py --decode).
#   7. the colocated server side on the GPU (benchmarks/bench_colocated.py --device cuda): a push by
#      update_weights_from_tensor (CUDA IPC) against a device copy of the same bytes, and the
#      server's torch.cuda.memory_allocated before and after each release / resume,
#   7. the colocated demo on one GPU (launch.placement=colocated, embedded server on the same card):
#      the card's free memory before/after each release, the trainer's torch.cuda.memory_allocated
#      before/after each offload, and the step time split generate / release / onload / train /
#      push / offload / wakes (benchmarks/colocated_split.py over its stats).
#
#   bash ci/gpu_local.sh
#
# Python packages the machine lacks can be put as wheels in .whl/ (installed to a scratch
# directory first). Without a GPU it says so and exits 0. The real-SGLang check is ci/gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "[gpu] no CUDA device here (nvidia-smi finds none): skipping the GPU check"
    exit 0
fi
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/arealite-site .whl/*.whl
    export PYTHONPATH=/tmp/arealite-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi -L
$PY -c 'import torch, transformers; print(f"[gpu] torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")'
status=0
$PY -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_fsdp.py tests/test_attention.py tests/test_parallel_compose.py tests/test_gpu.py tests/test_server_fp8.py "$@" || status=$?
$PY benchmarks/bench_mfu.py --steps ${MFU_STEPS:-4} || status=$?
$PY benchmarks/bench_plan_gpu.py || status=$?
$PY benchmarks/bench_fp8.py --decode || status=$?
$PY benchmarks/bench_colocated.py --device cuda --size large --rounds ${COLOCATED_ROUNDS:-5} || status=$?
COLO=${COLO_DIR:-/tmp/arealite-colocated}
rm -rf "$COLO" && $PY examples/reverse_digits/prepare.py --out "$COLO/demo" >/dev/null && \
$PY -m arealite.train --config examples/reverse_digits/config.yaml experiment.output_root="$COLO/runs" \
    experiment.name=colocated experiment.trial=gpu actor.model_path="$COLO/demo/model" \
    data.train_path="$COLO/demo/train.jsonl" data.eval_path="$COLO/demo/eval.jsonl" \
    launch.placement=colocated rollout.max_head_offpolicyness=0 launch.n_trainer_procs=1 \
    data.max_train_steps=${COLO_STEPS:-8} evaluation.freq_steps=null saver.freq_steps=null \
    stats.progress_bar=false stats.plot=false weight_sync.method=${COLO_PUSH:-tensor} && \
$PY benchmarks/colocated_split.py "$COLO/runs/colocated/gpu/stats.jsonl" || status=$?
exit $status
