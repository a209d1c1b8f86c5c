#!/usr/bin/env bash
# Example 2: the sequence-length warmup sweep and its report.
#
#   bash examples/warmup_sweep.sh     # durations 0.0, 0.1, 0.3, 0.5 x seeds 1, 2, 3: 12 jobs of 320 steps (~12 min on 2 free cores)
#   SWEEP_DIR=/tmp/sweep bash examples/warmup_sweep.sh trainer.max_steps=50 'callbacks.seq_warmup.duration=0.0,0.5' seed=1
#
# Extra arguments are seqmem-train overrides (a sweep value on the command line replaces the preset's).
# Writes <sweep dir>/<job>/progress.csv per job, then <sweep dir>/report.{md,csv,png} (and report_seeds.csv: mean
# ± sd over seeds).
set -euo pipefail
SWEEP_DIR="${SWEEP_DIR:-multirun/warmup_sweep_$(date +%Y%m%d-%H%M%S)}"

# A failed job does not stop the others; the report then lists it, so run the report whatever the sweep returned.
status=0
seqmem-train -m experiment=warmup_sweep hydra.sweep.dir="$SWEEP_DIR" "$@" || status=$?
seqmem-report "$SWEEP_DIR" ${REPORT_ARGS:-}
exit "$status"
