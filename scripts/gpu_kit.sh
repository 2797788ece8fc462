#!/usr/bin/env bash
# The folder scripts/gpu_check.sh carries to a GPU machine that has only torch, transformers,
# safetensors and numpy: wheels/ (pced without its dependencies, pytest and what pytest needs) and
# tokenizer/ (the embedded model's tokenizer files, for the random model and the test fixtures).
#
#   scripts/gpu_kit.sh [KIT]              # default KIT: runs/gpu-kit; prints its size
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-runs/gpu-kit}
PY=${PYTHON:-python}
rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/tokenizer"
$PY -m pip wheel --quiet --no-deps --no-build-isolation -w "$KIT/wheels" .
$PY -m pip download --quiet --no-deps --only-binary=:all: -d "$KIT/wheels" pytest pluggy iniconfig pygments
SOURCE=$($PY -c "from pced.llm import embedded_model_dir; print(embedded_model_dir())")
for name in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja generation_config.json; do
    [ -f "$SOURCE/$name" ] && cp "$SOURCE/$name" "$KIT/tokenizer/"
done
du -sh "$KIT" "$KIT/wheels" "$KIT/tokenizer"
ls -la "$KIT/wheels"
