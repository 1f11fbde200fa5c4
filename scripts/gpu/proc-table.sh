#!/usr/bin/env bash
# Record the real driver's cuGetProcAddress_v2 answers for every exported base name.
#
#   OUT=/some/folder bash scripts/gpu/proc-table.sh
#
# Builds tools/gpu/proc_table.c (no CUDA headers needed), runs it over
# remoting/shim/libcuda-580-exports.txt, writes remoting/shim/proc-table.tsv and copies it to
# $OUT/proc-table.tsv; the tool's stderr goes to $OUT/proc-table.log.
set -u -o pipefail
. "$(dirname "$0")/common.sh"

LOG="$OUT/proc-table.log"
TSV=remoting/shim/proc-table.tsv
EXPORTS=remoting/shim/libcuda-580-exports.txt

echo "== proc-table $(date -u +%Y-%m-%dT%H:%M:%SZ)" | tee "$LOG"
cc=$(command -v gcc || command -v cc || true)
if [ -z "$cc" ]; then
    echo "error: no C compiler" | tee -a "$LOG"
    exit 1
fi
if ! "$cc" -O2 -std=gnu11 -Wall -o "$WORK/proc_table" tools/gpu/proc_table.c -ldl >> "$LOG" 2>&1; then
    echo "error: building tools/gpu/proc_table.c failed (see $LOG)" | tee -a "$LOG"
    exit 1
fi
if ! "$WORK/proc_table" "$EXPORTS" > "$WORK/proc-table.tsv" 2>> "$LOG"; then
    echo "error: proc_table failed (see $LOG)" | tee -a "$LOG"
    tail -n 5 "$LOG"
    exit 1
fi
cp "$WORK/proc-table.tsv" "$TSV"
cp "$WORK/proc-table.tsv" "$OUT/proc-table.tsv"
tail -n 1 "$LOG"
echo "== proc-table: $(grep -vc '^#' "$TSV") rows, $(grep -v '^#' "$TSV" | awk -F'\t' '$4 == "-"' | wc -l) not-found rows -> $TSV, $OUT/proc-table.tsv" | tee -a "$LOG"
