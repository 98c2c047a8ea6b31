# Sourced first by every benchmarks/gpu_*.sh script (run from the repository root on the GPU host):
# unbuffered output, NVLink multicast off (shared/GPU.md), the tree importable as `speculant`
# from /tmp/spk, and with the argument `deepep` the DeepEP wheel carried in .whl/ installed into
# /tmp/site (the hosts have no package index).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p /tmp/spk && ln -sfn "$PWD" /tmp/spk/speculant
export PYTHONPATH=/tmp/spk
if [ "${1:-}" = deepep ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:/tmp/spk
fi

# The machine and the time, into $OUT/gpu.txt (every call records them first).
machine_header() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        | tee "$OUT/gpu.txt"
    date -u | tee -a "$OUT/gpu.txt"
}

# A 64-request job of the realistic mix, thrown away: a fresh machine compiles the Triton
# kernels here, not in the first measured run.
warm_up_job() {
    mkdir -p "$OUT/warm"
    (cd benchmarks && timeout 90 python3 workload.py --out "$OUT/warm" --requests 64 \
        --configs default --timeout 80 2>&1 | tail -2)
    rm -rf "$OUT/warm"
}
