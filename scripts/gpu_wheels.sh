#!/usr/bin/env bash
# Wheels for the GPU machine's Python (3.12, x86-64 manylinux) of what galley and its GPU check need
# and that machine lacks, at the versions installed here, into .whl/ (git-ignored; ~25 MB, carried
# with `carry: [".whl"]`). That machine has torch, numpy, aiohttp, uvloop, tokenizers, safetensors,
# prometheus-client, pytest, pytest-xdist and hypothesis (device README, KINDS.md); it has
# transformers 5.17, and the tests compare against the transformers (and PEFT) they run with, so ours travel.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(orjson structlog sqlite-utils sqlite-fts4 click-default-group pydantic pydantic-core annotated-types
          typing-inspection gguf llguidance pytest-aiohttp pytest-asyncio openai jiter distro sniffio transformers
          huggingface-hub jsonschema jsonschema-specifications referencing rpds-py peft
          httpx2 httpcore2 truststore)  # huggingface-hub 2 talks through httpx2
PLATFORMS=(--platform any --platform manylinux2014_x86_64)
for n in 17 24 27 28 31 34 35 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
pins=()
for name in "${PACKAGES[@]}"; do
    version=$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins+=("$name==$version")
done
rm -rf .whl && mkdir .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl "${pins[@]}"
du -sh .whl
