#!/bin/sh
# FlashInfer for tests/test_gpu_flashinfer.py on the GPU machine (Python 3.12, torch 2.11 +
# CUDA 13, nvcc 13.0, no internet), from the carry that bench/flashinfer_carry.sh builds.
# Takes the carry folder as $1 (default .dev-wheels/flashinfer under the repo root, this
# script's ../) and prints the exports to source, alone on stdout:
#
#   sh bench/flashinfer_install.sh > /tmp/fi.env && . /tmp/fi.env
#   python3 -P -m pytest -q -s tests/test_gpu_flashinfer.py
#
# What the carry holds (built on the development machine):
# - flashinfer.tar.xz: the `flashinfer` package of flashinfer_python-0.7.2.post1-py3-none-any.whl
#   (62 MB, pure Python plus CUDA sources JIT-built with nvcc and ninja), pruned: the
#   subfolders of flashinfer/data/csrc/ removed (the files directly in it, batch_prefill*,
#   batch_decode* and the rest, kept), data/include, data/cutlass, data/cccl, data/spdlog kept,
#   no __pycache__; `tar -cJf flashinfer.tar.xz flashinfer`.
# - apache_tvm_ffi-0.1.15.post2 (cp312, manylinux_2_28 x86_64): flashinfer requires
#   apache-tvm-ffi>=0.1.11,<0.2; its own only requirement, typing-extensions, comes with torch.
# - deps/: what `import flashinfer` imports beyond torch, numpy, jinja2, filelock and
#   typing-extensions (requests, urllib3, certifi, idna, charset_normalizer, tqdm, packaging,
#   nvidia-ml-py as pynvml), each installed only where python3 cannot import it already; and
#   ninja 1.13.2 (the JIT runs the `ninja` binary from PATH), used only where PATH has none.
#   flashinfer's other declared requirements (cuda-python, cuda-tile, nvidia-cutlass-dsl,
#   nvidia-cudnn-frontend, nccl4py, einops, click, tabulate, ...) are not imported by
#   `import flashinfer` nor by the fa2 paged prefill and decode wrappers.
# It also lays bufc out as its distribution does (bufc/ plus codegen, runtime, rules, requests,
# generated, schema, examples as subpackages, symlinked to this checkout), so that the tests'
# `from bufc.generated import ...` imports the checkout without pip or setuptools.
set -eu
exec 3>&1 1>&2  # stdout is for the exports alone
REPO=$(cd "$(dirname "$0")/.." && pwd)
# the copy the build leaves in the carry (.dev-wheels/flashinfer/INSTALL.sh) is two levels down
[ -d "$REPO/bufc" ] || REPO=$(cd "$REPO/.." && pwd)
HERE=$(cd "${1:-$REPO/.dev-wheels/flashinfer}" && pwd)
SITE=${SITE:-/tmp/site}  # removed and rebuilt: keep it for this alone
PY=${PYTHON:-python3}
PIP="$PY -m pip install -q --no-index --no-deps --no-compile --target $SITE"
rm -rf "$SITE"
mkdir -p "$SITE" /tmp/fiws
$PIP "$HERE"/apache_tvm_ffi-*.whl
for pair in requests:requests urllib3:urllib3 certifi:certifi idna:idna \
    charset_normalizer:charset_normalizer tqdm:tqdm packaging:packaging pynvml:nvidia_ml_py; do
    module=${pair%%:*}
    wheel=${pair#*:}
    # -P: the checkout's own requests/ folder (bufc.requests) must not pass for `requests`
    $PY -P -c "import $module" 2>/dev/null || $PIP "$HERE"/deps/"$wheel"-*.whl
done
if ! command -v ninja >/dev/null 2>&1; then  # its own target: pip merges no bin/ folders
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE/_ninja" \
        "$HERE"/deps/ninja-*.whl
fi
tar -xJf "$HERE/flashinfer.tar.xz" -C "$SITE"
mkdir "$SITE/bufc"
cp "$REPO"/bufc/*.py "$SITE/bufc/"
for folder in codegen runtime rules requests generated schema examples; do
    ln -s "$REPO/$folder" "$SITE/bufc/$folder"
done
mkdir "$SITE/bufc/spec"  # the built-in spec a project's `extends: bufc` reads
ln -s "$REPO/buffers.yaml" "$SITE/bufc/spec/buffers.yaml"
PYTHONPATH=$SITE $PY -P -c "import flashinfer, bufc.generated.llama_flashinfer; print('flashinfer', flashinfer.__version__, 'from', flashinfer.__file__)"
echo "export PYTHONPATH=$SITE FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fiws PATH=\"\$PATH:$SITE/_ninja/bin\"" >&3
