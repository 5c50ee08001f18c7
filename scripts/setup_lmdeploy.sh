#!/usr/bin/env bash
# Build the LMDeploy virtual environment that the LMDeploy adapter's tests and demos use, idempotently.
#
#   bash scripts/setup_lmdeploy.sh          # venv in $DLMIX_LMDEPLOY_VENV (default: .venv-lmdeploy next to this checkout)
#
# LMDeploy 0.18 pins torch<=2.12.1 and CUDA wheels, so it is installed without its dependencies, next to the CPU
# build of torch and the pure-Python dependencies its PyTorch engine and servers import. dlmix is installed editable
# into this venv; its `dlmix_lmdeploy.pth` hook (installed by the package) makes `--migration-backend DLMix` known to
# LMDeploy in every process. The CPU shim (plugins/lmdeploy/cpu.py) is a test and development aid, active only when
# DLMIX_LMDEPLOY_CPU=1. A second run does nothing unless this script or pyproject.toml changed (stamp file).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DLMIX_LMDEPLOY_VENV:-$here/.venv-lmdeploy}"
py="${PYTHON:-python3.11}"
. "$here/scripts/lock.sh"  # locked: editable installs of this checkout, one at a time
command -v "$py" >/dev/null || py=python3

stamp="$venv/.dlmix-lmdeploy-stamp"
want="$(cat "$here/pyproject.toml" "$here/setup.py" "$here/scripts/setup_lmdeploy.sh" 2>/dev/null | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$venv/bin/python" -c "import lmdeploy.pytorch.disagg.config, dlmix_lmdeploy" 2>/dev/null; then
  echo "[setup_lmdeploy] $venv is up to date"
  exit 0
fi
echo "[setup_lmdeploy] building $venv"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U pip wheel setuptools >/dev/null
"${pip[@]}" install "torch==2.13.0+cpu" || "${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install --no-deps "lmdeploy==0.18.0" "xgrammar==0.2.7" "apache-tvm-ffi==0.1.11"
"${pip[@]}" install numpy tqdm pydantic "transformers==5.19.0" mmengine-lite psutil pillow requests pybase64 aiohttp \
  shortuuid pyzmq cloudpickle prometheus_client partial_json_parser "openai==2.8.0" openai_harmony fastapi uvicorn \
  safetensors sentencepiece "tokenizers==0.23.2" einops pyyaml msgspec httpx typer rich httptools uvloop fire \
  ninja termcolor
"${pip[@]}" uninstall -y triton torchvision >/dev/null 2>&1 || true
locked "${pip[@]}" install -e "$here"
# An editable install does not run the build step that ships dlmix_lmdeploy.pth (a wheel has it): write it here.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
[ -f "$site/dlmix_lmdeploy.pth" ] || cp "$here/plugins/lmdeploy/dlmix_lmdeploy.pth" "$site/"
"$venv/bin/python" -c "import lmdeploy, sys; from lmdeploy.pytorch.disagg.config import MigrationBackend as M; print('[setup_lmdeploy] lmdeploy', lmdeploy.__version__, [m.name for m in M]); sys.exit(0 if 'DLMix' in M.__members__ else 1)"
echo "$want" > "$stamp"
