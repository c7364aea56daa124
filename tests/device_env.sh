# Sourced by the device-machine scripts (tests/run_gpu_suite.sh, benchmarks/run_suite.sh):
# $OUT for logs, NVLink multicast off, carried wheels from .whl/ on PYTHONPATH, the repo importable,
# the CUTLASS kernel cache in .kcache/ (carried) unless TE_DIST_CACHE says otherwise.
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TE_DIST_CACHE=${TE_DIST_CACHE:-$PWD/.kcache}
# Kernels travel packed (the .so files are over the carry limit unpacked): unpack .kcache/*.tgz in place.
for packed in .kcache/*.tgz; do if [ -e "$packed" ]; then tar xzf "$packed" -C .kcache; fi; done
