#!/usr/bin/env bash
# Create the optional vLLM environment for the `vllm`-marked tests (tests/vllm/).
# Usage: scripts/make-vllm-env.sh [VENV_DIR]   (default /work/vllm-venv)
# vLLM 0.33.0 pulls torch 2.14 (a multi-GB download); this takes several minutes.
set -euo pipefail
venv="${1:-/work/vllm-venv}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "vllm==0.33.0"
"$venv/bin/pip" install -q -e "$repo" pytest
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "run: cd $repo && $venv/bin/pytest -m vllm tests/vllm"
