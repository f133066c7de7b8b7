#!/usr/bin/env bash
# The scale bench on a GPU machine, one command (run it only where the device tool
# reports a lent machine; nothing depends on it):
#
#     bash bench/gpu_scale.sh            # writes $OUT/gpu_scale.json (OUT: bench/results)
#
# A random LLaVA-1.5-7B-shaped model built from a config (Llama d_model 4096, 32
# layers of 32 heads, SwiGLU 11008; CLIP ViT-L/14), bfloat16 on the GPU, at 600 and
# 2,900 tokens: capture / forward, analyze / forward, eager capture / forward and
# peak CUDA memory above the allocated memory before each call, paired call by call
# in one process (bench/scale.py). Prints the table and the line fit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
exec "$PY" bench/scale.py --device cuda --dtype bfloat16 --preset llava-7b --tokens 600 2900 \
    --rounds 5 3 --eager-up-to 3000 --threads 4 --json "${OUT:-bench/results}/gpu_scale.json" "$@"
