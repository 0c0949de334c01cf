# torch 2.13.0 (CUDA 13.0) and triton 3.7.1 for a GPU machine that has another torch and no network, carried
# in pieces small enough to send one at a time (how the H100 runs in the README were set up):
#
#   bash bench/gpu_setup.sh pack OUT_DIR [PIECE_MB]     here: download the cp312 wheels (pip download), tar +
#                                                       xz them, split into pieces of PIECE_MB (default 58)
#   source bench/gpu_setup.sh unpack PIECES_DIR         there: extract the pieces to /tmp/site (once), export
#                                                       PYTHONPATH=/tmp/site:$PWD, and LD_PRELOAD a stub of each
#                                                       NCCL function torch links that the machine's NCCL lacks
#
# Then `bash bench/gpu.sh` (or any of its steps) runs with torch 2.13 there. The machine must hold Python 3.12
# with the CUDA 13 libraries torch loads (its nvidia-* packages: cuBLAS, cuDNN, NCCL, ...), xz and gcc.
# A call of the device tool removes the ignored paths it does not carry: move each piece out of the checkout
# (e.g. `mkdir -p /tmp/p && mv .gpu/piece_* /tmp/p/`) in the call that brings it, then unpack /tmp/p.
# The stubs are never called by fsdp_compile (suspend/resume, symmetric-memory signals, memory stats): a
# call would return ncclInvalidUsage. Packing takes 10 to 40 minutes on 2 cores (521 MB of pieces).

_gpu_setup_pack() {
    local out=${1:?usage: bash bench/gpu_setup.sh pack OUT_DIR [PIECE_MB]} mb=${2:-58} tmp
    tmp=$(mktemp -d)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$tmp/whl" torch==2.13.0 triton==3.7.1 || return 1
    mkdir -p "$tmp/site" "$out"
    for w in "$tmp"/whl/*.whl; do (cd "$tmp/site" && python3 -m zipfile -e "$w" .) || return 1; done
    (cd "$tmp/site" && tar cf - .) | xz -9 -T0 > "$tmp/site.tar.xz" || return 1
    split -b "${mb}M" -d -a 2 "$tmp/site.tar.xz" "$out/piece_"
    rm -rf "$tmp"
    ls -l "$out"
}

_gpu_setup_unpack() {
    local pieces=${1:?usage: source bench/gpu_setup.sh unpack PIECES_DIR} stub=/tmp/nccl_stub
    if [ ! -f /tmp/site/torch/__init__.py ]; then
        rm -rf /tmp/site && mkdir -p /tmp/site
        cat "$pieces"/piece_* | xz -d -T0 | tar x -C /tmp/site || return 1
        # python -m zipfile drops file modes: Triton's ptxas, cuobjdump and nvdisasm must be executable
        chmod +x /tmp/site/triton/backends/nvidia/bin/* || return 1
    fi
    export PYTHONPATH=/tmp/site:$PWD
    # Stub what the machine's NCCL lacks, one symbol at a time as the import names it.
    : > "$stub.c"
    local missing i
    for i in $(seq 1 40); do
        gcc -shared -fPIC -O2 -o "$stub.so" "$stub.c" || return 1
        missing=$(LD_PRELOAD="$stub.so" python3 -c "import torch" 2>&1 | grep -o "undefined symbol: [A-Za-z0-9_]*" | head -1 | cut -d' ' -f3)
        [ -z "$missing" ] && break
        echo "gpu_setup: stubbing $missing (not in this machine's NCCL)"
        echo "int $missing(void) { return 5; /* ncclInvalidUsage */ }" >> "$stub.c"
    done
    export LD_PRELOAD=$stub.so
    python3 -c "import torch, triton; print('gpu_setup: torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__, 'NCCL', torch.cuda.nccl.version(), 'GPU', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
}

case "${1:-}" in
    pack) shift; _gpu_setup_pack "$@" ;;
    unpack) shift; _gpu_setup_unpack "$@" ;;
    *) echo "usage: bash bench/gpu_setup.sh pack OUT_DIR [PIECE_MB] | source bench/gpu_setup.sh unpack PIECES_DIR" >&2 ;;
esac
