#!/usr/bin/env bash
# One-GPU check of vitp (H200 target, under 10 minutes): bf16 + NCCL training with the real trainer,
# the SDPA kernel in use, text conditioning (bf16 cross-attention), cp=2 (Ulysses, ring; torchrun on 2 GPUs, skipped with fewer) against cp=1,
# MFU of JiT-B/L generators at 256 tokens (256 px and 1024 px), compiled blocks (trainer.compile=blocks) against eager MFU, and the planner's per-rank memory against torch.cuda.max_memory_allocated. Prints one table; results go
# to $OUT (or --out DIR; default ./gpu_check_out) as gpu_check.json plus one JSON and log per check.
#
#   bash scripts/gpu_check.sh                 # all checks
#   bash scripts/gpu_check.sh --only sdpa     # some of them (bf16_nccl, sdpa, cp, mfu_jit_b_256px, ...)
#   bash scripts/gpu_check.sh --cpu-smoke     # tiny model on CPU with gloo (seconds): tests the script
#
# Needs a Python with vitp's dependencies (a CUDA build of torch); PYTHON picks the interpreter.
# Each check has its own timeout (scripts/gpu_check.py); the whole run is capped at 600 s.
set -u
cd "$(dirname "$0")/.."
exec timeout --signal=TERM --kill-after=10 600 \
    "${PYTHON:-python}" scripts/gpu_check.py --out "${OUT:-gpu_check_out}" "$@"
