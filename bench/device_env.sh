#!/bin/sh
# On the GPU machine (Python 3.12, torch with CUDA, no internet): bufc laid out from this
# checkout as its distribution does, and jsonschema with its dependencies from the carried
# wheels (.dev-wheels/deps); prints the export to source, alone on stdout:
#
#   sh bench/device_env.sh > /tmp/bufc.env && . /tmp/bufc.env
#   BUFC_DEVICE=cuda python3 -P -m pytest -q tests/test_device_build.py
#   python3 -P bench/device_build.py
set -eu
exec 3>&1 1>&2  # stdout is for the export alone
REPO=$(cd "$(dirname "$0")/.." && pwd)
SITE=${SITE:-/tmp/site}  # removed and rebuilt
rm -rf "$SITE"
mkdir -p "$SITE/bufc/spec"
cp "$REPO"/bufc/*.py "$SITE/bufc/"
for folder in codegen runtime rules requests generated schema examples; do
    ln -s "$REPO/$folder" "$SITE/bufc/$folder"
done
ln -s "$REPO/buffers.yaml" "$SITE/bufc/spec/buffers.yaml"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    "$REPO"/.dev-wheels/deps/*.whl
echo "export PYTHONPATH=$SITE" >&3
