#!/usr/bin/env bash
# Fetches the OpenVINO runtime libraries from the PyPI `openvino` wheel into third_party/openvino/ (no root, no
# Python environment needed to use them: the wheel's libs/ folder is self-contained, RPATH $ORIGIN).
# Idempotent: does nothing when the pinned version is already there. Prints the libopenvino_c path.
set -euo pipefail
VERSION="${OPENVINO_VERSION:-2026.4.1}"
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/third_party/openvino"
stamp="$dest/VERSION"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$VERSION" ] && ls "$dest"/libopenvino_c.so.* >/dev/null 2>&1; then
  ls "$dest"/libopenvino_c.so.*
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --python-version 3.11 \
  "openvino==$VERSION" -d "$tmp" >&2
wheel="$(ls "$tmp"/openvino-*.whl)"
python3 - "$wheel" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("openvino/libs/") and not name.endswith("/"):
            z.extract(name, sys.argv[2])
PY
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp"/x/openvino/libs/* "$dest"/
echo "$VERSION" > "$stamp"
ls "$dest"/libopenvino_c.so.*
