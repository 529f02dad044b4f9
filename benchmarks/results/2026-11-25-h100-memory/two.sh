#!/usr/bin/env bash
# after the capture-stream fix: the diagnosis again (4k, Full KV), then the soak
set -uo pipefail
out=${OUT:-/tmp/out}
PYTHONPATH=$PWD timeout 120 python .gpu/diag.py 2>&1 | grep -v Warn | grep -v Writing | tee $out/diag_after.log
bash .gpu/soak.sh . "$@"
