#!/usr/bin/env bash
# A separate virtual environment for NVIDIA's kvpress (benchmarks/kvpress_needle.py), never the project's:
# kvpress 0.5.5 pins transformers < 5.3 while bhqk runs on transformers 5.x.
#
#   bash benchmarks/kvpress_env.sh [VENV]        # default /tmp/bhqk-kvpress-venv (or $KVPRESS_VENV)
#   VENV/bin/python benchmarks/kvpress_needle.py --model ~/.cache/bhqk/SmolLM2-135M-Instruct.Q4_1-<hash>
#
# torch is installed first and pinned to the CPU build (torch==2.13.0, the +cpu wheel where one lies on
# disk): an unpinned torch resolves to the multi-GB CUDA build. kvpress and its dependencies are then
# installed under a constraint that keeps that torch, so nothing swaps it for another build.
set -euo pipefail

VENV="${1:-${KVPRESS_VENV:-/tmp/bhqk-kvpress-venv}}"
TORCH="${KVPRESS_TORCH:-torch==2.13.0}"  # cpu_venv reads it
KVPRESS="${KVPRESS_VERSION:-kvpress==0.5.5}"

# shellcheck source=benchmarks/cpu_venv.sh
. "$(dirname "$0")/cpu_venv.sh"
cpu_venv kvpress_env "$VENV"  # PIP, TORCH_INSTALLED
installed="$TORCH_INSTALLED"

# 2. kvpress and whatever transformers it accepts (< 5.3), with torch held where it is.
cons=$(mktemp)
echo "torch==$installed" > "$cons"
"${PIP[@]}" install -c "$cons" "$KVPRESS"
rm -f "$cons"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
print("kvpress env:", {p: md.version(p) for p in ("kvpress", "transformers", "torch", "accelerate")},
      "cuda:", torch.version.cuda)
EOF
