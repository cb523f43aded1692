#!/usr/bin/env bash
# A separate virtual environment for Hugging Face's quantized KV caches (benchmarks/hf_quantized.py), never
# the project's: optimum-quanto and hqq are backends of transformers' QuantizedCache, not dependencies of bhqk.
#
#   bash benchmarks/quanto_env.sh [VENV]        # default /tmp/bhqk-quanto-venv (or $QUANTO_VENV)
#   VENV/bin/python benchmarks/hf_quantized.py --model ~/.cache/bhqk/SmolLM2-135M-Instruct.Q4_1-<hash>
#
# torch is installed first and pinned to the CPU build (torch==2.13.0, the +cpu wheel where one lies on disk),
# transformers to the project's lock (constraints.txt), and everything after that is installed under a
# constraint that keeps both, so neither quanto nor hqq swaps them. hqq is optional: when it fails to install
# or to import on the CPU, the error is written to VENV/hqq-error.txt and the script carries on without it.
set -euo pipefail

VENV="${1:-${QUANTO_VENV:-/tmp/bhqk-quanto-venv}}"
ROOT="$(readlink -f "$(dirname "$0")/..")"
TORCH="${QUANTO_TORCH:-torch==2.13.0}"  # cpu_venv reads it
QUANTO="${QUANTO_VERSION:-optimum-quanto==0.2.7}"
HQQ="${HQQ_VERSION:-hqq==0.2.8.post1}"

# shellcheck source=benchmarks/cpu_venv.sh
. "$(dirname "$0")/cpu_venv.sh"
cpu_venv quanto_env "$VENV"  # PIP, TORCH_INSTALLED
installed="$TORCH_INSTALLED"

# 2. transformers at the project's lock, then optimum-quanto, torch and transformers held where they are.
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
echo "torch==$installed" > "$cons"
grep -E '^(transformers|tokenizers|safetensors|huggingface_hub|accelerate|numpy)==' "$ROOT/constraints.txt" >> "$cons"
"${PIP[@]}" install -c "$cons" transformers accelerate "$QUANTO"

# 3. hqq, optional: record why when it does not install or import on this CPU.
rm -f "$VENV/hqq-error.txt"
if ! "${PIP[@]}" install -c "$cons" "$HQQ" > "$VENV/hqq-install.log" 2>&1; then
  tail -n 30 "$VENV/hqq-install.log" > "$VENV/hqq-error.txt"
elif ! "$VENV/bin/python" -c 'import hqq.core.quantize' > "$VENV/hqq-import.log" 2>&1; then
  tail -n 30 "$VENV/hqq-import.log" > "$VENV/hqq-error.txt"
fi
[ -f "$VENV/hqq-error.txt" ] && { echo "quanto_env: hqq unavailable, see $VENV/hqq-error.txt:" >&2; tail -n 5 "$VENV/hqq-error.txt" >&2; }

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import torch
names = ("optimum-quanto", "hqq", "transformers", "torch", "accelerate")
versions = {}
for p in names:
    try:
        versions[p] = md.version(p)
    except md.PackageNotFoundError:
        versions[p] = None
print("quanto env:", versions, "cuda:", torch.version.cuda)
PYEOF
