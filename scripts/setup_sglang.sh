#!/usr/bin/env bash
# Build the SGLang virtual environment that the SGLang adapter's tests and demos use, idempotently.
#
#   bash scripts/setup_sglang.sh            # venv in $DLMIX_SGLANG_VENV (default: .venv-sglang next to this checkout)
#
# SGLang 0.5.23 pins torch 2.14.1 and a CUDA-13 stack, so it is installed without its dependencies, next to the CPU
# build of torch and the list of pure-Python dependencies its server imports. On a CPU-only machine two import-only
# stand-ins (plugins/sglang/standins: `sgl_kernel`, `torchvision`) go on the venv's path through a .pth file; they
# are only imported when a real one is missing. dlmix is installed editable INTO THIS VENV ONLY, so SGLang finds the
# `dlmix` transfer backend through its `sglang.srt.plugins` entry point. A second run does nothing unless this
# script or pyproject.toml changed (stamp file).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DLMIX_SGLANG_VENV:-$here/.venv-sglang}"
py="${PYTHON:-python3.11}"
. "$here/scripts/lock.sh"  # locked: editable installs of this checkout, one at a time
command -v "$py" >/dev/null || py=python3

stamp="$venv/.dlmix-sglang-stamp"
want="$(cat "$here/pyproject.toml" "$here/scripts/setup_sglang.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$venv/bin/python" -c "import sglang.srt.server_args, dlmix_sglang" 2>/dev/null; then
  echo "[setup_sglang] $venv is up to date"
  exit 0
fi
echo "[setup_sglang] building $venv"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U pip wheel setuptools >/dev/null
"${pip[@]}" install "torch==2.13.0+cpu" || "${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install --no-deps "sglang==0.5.23"
"${pip[@]}" install numpy orjson psutil pybase64 requests packaging starlette msgspec pydantic pyzmq tqdm IPython \
  aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" \
  gguf "openai==2.8.0" partial-json-parser einops prometheus_client fastapi uvicorn uvloop setproctitle \
  python-multipart interegular pillow "tokenizers==0.23.2" xxhash zstandard regex scipy distro "xgrammar==0.2.7" \
  jsonschema "soundfile==0.13.1" safetensors httpx pyyaml typer rich httptools
# A CUDA torchvision (pulled by a dependency) breaks imports next to the CPU torch; triton stays (sglang imports it).
"${pip[@]}" uninstall -y torchvision >/dev/null 2>&1 || true
# SGLang's own PD router (the dlmix backend works behind it unchanged; tests/test_sglang_pd.py checks it).
"${pip[@]}" install "sglang-router==0.3.2" || echo "[setup_sglang] sglang-router not installed: its test will skip"
# Optional: the Mooncake backend (SGLang's default) over TCP, the baseline of benchmarks/pd_sglang.py.
"${pip[@]}" install "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
  || echo "[setup_sglang] mooncake not installed: the Mooncake baseline will be skipped"
# The CPU stand-ins, only where no real sgl_kernel/torchvision is installed.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sgl_kernel') is None)"; then
  echo "$here/plugins/sglang/standins" > "$site/dlmix_sglang_standins.pth"
fi
locked "${pip[@]}" install --no-deps -e "$here"
"$venv/bin/python" -c "import sglang, dlmix_sglang; print('[setup_sglang] sglang', sglang.__version__)"
echo "$want" > "$stamp"
