#!/usr/bin/env bash
# Record NVIDIA's answers to the CUDA runtime's integrity check, with every input they depend on, and survey
# the driver's export tables (tools/gpu/integrity_probe.c). Needs only gcc and the driver; takes a second.
#
#   OUT=/some/folder bash scripts/gpu/integrity-probe.sh
#
# $OUT afterwards: integrity-fixture.txt (copy it to remoting/shim/tests/fixtures/: the replay test in
# remoting/shim/src/integrity.rs then runs), export-tables.txt (the survey), integrity-probe.log.
set -u -o pipefail
. "$(dirname "$0")/common.sh"

LOG="$OUT/integrity-probe.log"
{
    echo "== integrity-probe $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,driver_version,pci.bus_id,uuid --format=csv,noheader 2>&1 || true
} > "$LOG"
if ! gcc -O1 -Wall -o "$WORK/integrity_probe" tools/gpu/integrity_probe.c -ldl -lpthread >> "$LOG" 2>&1; then
    echo "integrity-probe: the probe did not build (see $LOG)" | tee -a "$LOG"
    exit 1
fi
"$WORK/integrity_probe" > "$OUT/integrity-fixture.txt" 2> "$OUT/export-tables.txt"
rc=$?
echo "probe exit $rc; $(grep -c '^case ' "$OUT/integrity-fixture.txt") cases" | tee -a "$LOG"
head -n 12 "$OUT/integrity-fixture.txt" | tee -a "$LOG"
grep -E '^(table|before_cuInit|null_)' "$OUT/export-tables.txt" | tee -a "$LOG"
exit "$rc"
