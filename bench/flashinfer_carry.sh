#!/bin/sh
# Builds the carry that tests/test_gpu_flashinfer.py needs on the GPU machine (no internet
# there): on a development machine with the network (about 80 MB downloaded, 17 MB kept), from
# the repo root or anywhere:
#
#   sh bench/flashinfer_carry.sh [OUTDIR]   # default: .dev-wheels/flashinfer under the repo root
#
# OUTDIR gets flashinfer.tar.xz (flashinfer-python 0.7.2.post1's `flashinfer` package, pruned),
# the apache-tvm-ffi cp312 wheel, deps/ (the wheels `import flashinfer` needs, and ninja) and
# INSTALL.sh, a copy of bench/flashinfer_install.sh, whose header says what each one is for.
# The versions are pinned; pip (python3 on PATH) fetches wheels for CPython 3.12 on x86_64
# manylinux, whatever this machine runs.
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$REPO/.dev-wheels/flashinfer}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
trap 'exit 1' HUP INT TERM
download() {  # DEST REQUIREMENT...
    dest=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest" \
        --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "$@"
}
download "$TMP/wheels" flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
download "$TMP/deps" requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 idna==3.21 \
    charset-normalizer==3.5.3 tqdm==4.70.1 packaging==26.4 nvidia-ml-py==13.615.71 ninja==1.13.2
# the wheel's `flashinfer` package less the subfolders of data/csrc/ (the JIT of the fa2 paged
# prefill and decode kernels reads only the files directly in it, data/include and the headers
# of data/cutlass, data/cccl and data/spdlog) and any __pycache__
mkdir "$TMP/unpacked"
python3 -m zipfile -e "$TMP"/wheels/flashinfer_python-0.7.2.post1-py3-none-any.whl "$TMP/unpacked"
find "$TMP/unpacked/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$TMP/unpacked/flashinfer" -name __pycache__ -prune -exec rm -rf {} +
(cd "$TMP/unpacked" && tar -cJf "$TMP/flashinfer.tar.xz" flashinfer)
rm -rf "$OUT/deps" "$OUT/flashinfer.tar.xz" "$OUT/INSTALL.sh" "$OUT"/apache_tvm_ffi-*.whl
mv "$TMP/flashinfer.tar.xz" "$TMP"/wheels/apache_tvm_ffi-*.whl "$TMP/deps" "$OUT/"
cp "$REPO/bench/flashinfer_install.sh" "$OUT/INSTALL.sh"
echo "carry built in $OUT:" >&2
ls -lR "$OUT" >&2
