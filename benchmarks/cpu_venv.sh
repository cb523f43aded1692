# Sourced by benchmarks/kvpress_env.sh and benchmarks/quanto_env.sh: a comparison's own virtual environment
# with PyTorch's CPU build, never the project's.
#
#   cpu_venv NAME VENV      # sets PIP (an array: VENV's pip) and TORCH_INSTALLED (e.g. 2.13.0+cpu)
#
# Refuses the project's .venv; makes VENV if missing; installs torch (the local +cpu wheel under /opt/wheels
# where one lies, else ${TORCH:-torch==2.13.0}: an unpinned torch resolves to the multi-GB CUDA build) and
# fails if it is a CUDA build anyway.
cpu_venv() {
  local name="$1" venv="$2" root wheel
  root="$(readlink -f "$(dirname "${BASH_SOURCE[0]}")/..")"
  case "$(readlink -f "$venv")" in
    "$root/.venv"*) echo "$name: refusing to install into the project's venv ($venv)" >&2; exit 2 ;;
  esac
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3.11}" -m venv "$venv"
  PIP=("$venv/bin/python" -m pip --disable-pip-version-check)
  wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then "${PIP[@]}" install "$wheel"; else "${PIP[@]}" install "${TORCH:-torch==2.13.0}"; fi
  TORCH_INSTALLED=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  case "$TORCH_INSTALLED" in
    *+cu*) echo "$name: torch $TORCH_INSTALLED is a CUDA build; expected the CPU build" >&2; exit 1 ;;
  esac
}
