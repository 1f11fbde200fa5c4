#!/usr/bin/env bash
# Part A in one go: conformance recording and the cuGetProcAddress table.
#
#   OUT=/some/folder bash scripts/gpu/part-a.sh
#
# $OUT afterwards: conformance.tgz, conformance.log, proc-table.tsv, proc-table.log, part-a.log.
set -u -o pipefail
if [ -z "${OUT:-}" ]; then
    echo "error: OUT must name the folder whose files come back" >&2
    exit 1
fi
mkdir -p "$OUT"
here=$(dirname "$0")

bash "$here/record-conformance.sh"
conf_rc=$?
bash "$here/proc-table.sh"
proc_rc=$?

{
    echo "== part A summary"
    grep -E '^(ptx  FAIL|case FAIL|harness|== conformance|== bundle)' "$OUT/conformance.log" 2>/dev/null
    grep -E '^(== proc-table:|proc_table: driver|error)' "$OUT/proc-table.log" 2>/dev/null
    echo "record-conformance exit $conf_rc, proc-table exit $proc_rc"
    ls -l "$OUT"
} | tee "$OUT/part-a.log"
[ "$conf_rc" -eq 0 ] && [ "$proc_rc" -eq 0 ]
