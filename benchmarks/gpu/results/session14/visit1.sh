#!/usr/bin/env bash
# Session 14, visit 1: the whole GPU suite at main's HEAD (never concluded in session 13).
# GIT_COMMIT=<sha> bash benchmarks/gpu/results/session14/visit1.sh
BUDGET=${BUDGET:-585}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
TAILN=40 step gpu-suite 575 env LOG=$OUT/gpu-suite-full.log bash benchmarks/gpu/run_gpu_tests.sh -m gpu --maxfail=30
