#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (docs/gpu.md): Python 3.12 there, torch 2.11 + CUDA, no
# network. Builds into .gpu-wheels/ (ignored; carried by the device call) the cp312-compatible
# wheels of ckptsup's dependencies that its image does not hold, and ckptsup itself as a
# py3-none-any wheel; checks the total against the 64 MiB a call may carry; prints the one
# command line to run there.
#
#   PYTHON=/work/main/.venv/bin/python bench/gpu_wheels.sh [DEST]
#
# Preinstalled there (KINDS.md's list), so not carried: torch, click, psutil, rich, xxhash, numpy,
# requests, urllib3, lightning, transformers, accelerate. The pins are the versions the suite ran with.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/.gpu-wheels}
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
PINNED=(structlog==26.1.0 tenacity==9.2.1 torchdata==0.11.0 setproctitle==1.3.8)
SDIST_ONLY=(python-hostlist==2.3.0)   # publishes no wheel: built here (pure Python)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

rm -rf "$DEST"
mkdir -p "$DEST"
# --no-deps: their own needs are preinstalled there (torchdata: torch, requests, urllib3)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${PINNED[@]}"
"$PY" -m pip wheel -q --no-deps -w "$DEST" "${SDIST_ONLY[@]}"
# ckptsup from this tree (its wheel holds ckptsup/_data through the package-data symlinks)
build=$(mktemp -d)
cp -a "$ROOT/." "$build/src"
rm -rf "$build/src/.gpu-wheels" "$build/src/build" "$build/src"/*.egg-info
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$build/src"
rm -rf "$build"

for w in "$DEST"/*.whl; do
  case "$(basename "$w")" in
    *-py3-none-any.whl|*-cp312-*|*-abi3-*) ;;
    *) echo "gpu_wheels: $(basename "$w") is not for CPython 3.12 on x86-64" >&2; exit 1 ;;
  esac
done
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
ls -l "$DEST"
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $total bytes; with the working tree ($tree bytes): $((total + tree)) of $LIMIT"
if [ $((total + tree)) -ge $LIMIT ]; then
  echo "gpu_wheels: over the 64 MiB a device call may carry" >&2
  exit 1
fi
cat <<CMD
run on the device (carry: [".gpu-wheels"], timeout_s 480):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-wheels/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 300 --out \$OUT/gpu_check.json
CMD
