#!/usr/bin/env bash
# Rerun the torchft feasibility drills (CPU, gloo, loopback). Needs .tft-venv (see README.md).
set -u
cd "$(dirname "$0")"
PY=.tft-venv/bin/python
run() { name=$1; shift; echo "=== $name: $*"; timeout 280 $PY drill.py "out_$name" --deadline-s 250 --step-s 0.5 --steps 60 "$@" 2>&1 | tail -16; }
run smoke_1x1 --steps 10 --no-kill
run 1x1_kill_between --reduce ddp                       # kill lands after the all-reduce: torchft DDP survives
run 2x2_kill_between --reduce ddp --nproc 2
run 1x1_kill_mid_ddp --reduce ddp --compute-first       # kill lands before the all-reduce: survivor crashes (AssertionError)
run 1x1_kill_mid_manual --reduce manual --compute-first # same kill, manager.allreduce + wait(): survivor goes on
run 1x1_stop_manual --reduce manual --compute-first --kill-signal STOP  # hung peer: gloo timeout path
run 2x2_kill_mid_manual --reduce manual --compute-first --nproc 2
