#!/usr/bin/env bash
# Run here, from the project root, before a device run: fills .device/ (git-ignored) with the
# wheels the GPU machine lacks (worked out from pyproject.toml by requirements.py, at this venv's
# versions, built for the device's Python 3.12) and the embedded model's tokenizer and config.
#   bash bench/device/prepare.sh
# Then, through the device tool:  command="bash bench/device/run.sh"  carry=[".device"]
set -euo pipefail
[ -f pyproject.toml ] || { echo "run from the project root"; exit 1; }
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'make install' first"; exit 1; }
mkdir -p .device/whl .device/tok
rm -f .device/whl/*.whl
SPECS=$($PY bench/device/requirements.py)
echo "wheels: $SPECS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .device/whl $SPECS
$PY bench/device/requirements.py --tokenizer .device/tok
du -sh .device
