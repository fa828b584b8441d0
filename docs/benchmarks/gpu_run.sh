#!/usr/bin/env bash
# The GPU checks and step benchmarks, as one script for a lent GPU machine (one session's device
# time is 15 minutes, so everything runs in one call of about 8 minutes):
#   1. the CUDA tests: book-keeping = vmap in float64 on the GPU, a private step that stays on the
#      device with noise of the right scale, bf16 autocast with float32 clipping and noise, and the
#      secure normals drawn for the GPU (tests/dpcore/test_on_cuda.py, test_secure_randomness.py);
#   2. one secure noise draw for the GPU (docs/benchmarks/secure_noise.py --device cuda);
#   3. `dp-platform bench` on the GPU: MNIST CNN (batch 256), ResNet-9 and WRN-16-4 (batch 64);
#   4. the text fine-tuning step (docs/benchmarks/text_step.py --device cuda), T = 128 and 256;
#   5. (profile) where ours spends a step's time there (docs/benchmarks/gpu_profile.py).
# SECTIONS picks some (default "tests noise bench text"); TEXT_ARGS and BENCH_ARGS add flags to those two;
# TEXT_TIMEOUT (seconds, default 330) bounds the text part.
#
# Usage, from the repository root on the GPU machine:
#   bash docs/benchmarks/gpu_run.sh OUTDIR [WHEELS] [MODEL16]
# WHEELS: a folder of wheels the machine lacks (opacus, dp-accounting and its dm-tree, cryptography
# and its cffi, pycparser), installed into /tmp/site. MODEL16: the all-MiniLM-L6-v2 folder with its
# weights as model.fp16.safetensors (the device tool carries at most 64 MiB; the float32 file is
# 87 MiB), widened back to float32 here; step times do not depend on the weights' values.
set -uo pipefail
out=${1:?an output folder}
wheels=${2:-}
model16=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD"
fi
section() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
sections=" ${SECTIONS:-tests noise bench text} "
want() { [[ "$sections" == *" $1 "* ]]; }

section machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/machine.txt"
python3 -c "import os, torch, transformers, peft, opacus; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'opacus', opacus.__version__, 'cpus', os.cpu_count())" | tee -a "$out/machine.txt"

want tests && section "CUDA tests" && timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/dpcore/test_on_cuda.py \
  "tests/dpcore/test_secure_randomness.py::test_secure_normals_for_a_gpu_are_box_muller_there_of_host_keystream_pieces" \
  2>&1 | tail -25 | tee "$out/tests.txt"

want noise && section "secure noise" && timeout 120 python3 docs/benchmarks/secure_noise.py --device cuda --repeats 7 --threads 4 2>&1 | tee "$out/noise.md"

# shellcheck disable=SC2086  # BENCH_ARGS are several flags
want bench && section "dp-platform bench (vision)" && timeout 240 python3 -m pipelines.ops.bench_cli --device cuda --threads 4 --rounds 20 \
  --models mnist_cnn resnet9 wrn16_4 --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | grep -v "^timing" | tee "$out/bench.md"

if [ -n "$model16" ]; then
  python3 - "$model16" /tmp/minilm <<'EOF'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.fp16.safetensors"))
w = load_file(str(src / "model.fp16.safetensors"))
save_file({k: (v.float() if v.is_floating_point() else v) for k, v in w.items()}, str(dst / "model.safetensors"))
EOF
fi
# shellcheck disable=SC2086  # TEXT_ARGS are several flags
want text && section "text step" && timeout "${TEXT_TIMEOUT:-330}" python3 docs/benchmarks/text_step.py --device cuda \
  --model-folder /tmp/minilm --batch 32 --steps 10 --threads 4 ${TEXT_ARGS:-} 2>&1 | tee "$out/text.md"
want profile && section profile && timeout 150 python3 docs/benchmarks/gpu_profile.py --model-folder /tmp/minilm \
  2>&1 | grep -v -e USDT -e "^ERROR:.*gpuGetDeviceCount" | tee "$out/profile.txt"
section done
