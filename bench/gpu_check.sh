#!/usr/bin/env bash
# The GPU path on a machine with one GPU and the GPU extras (pip install -e '.[sglang,trainer]', or the GPU image):
# the farm on SGLang under Ray Serve at a half-GPU share and on the whole GPU, a rollout, a session turn, a weight
# push by path and by NCCL (gloo on one GPU), and the CUDA trainer's first step against the CPU one. One line per
# check, PASS, FAIL or SKIP with its figure or reason; each check has its own timeout and the whole fits in
# 10 minutes. Without a GPU, or without sglang or ray, one SKIP line with the reason, and exit 0. Exit 1 if a check
# failed. Logs: bench/results/gpu_check/. Not part of `make test`. Run from anywhere:
#     bash bench/gpu_check.sh [--model tiny|arith-tiny|smollm2|FOLDER] [--only CHECK,...]
# PYTHON picks the interpreter (default: the repository's .venv, else python3 on the PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the checks' own timeouts end it first (bench/gpu_check.py budgets START_S + TOTAL_S = 570 s at worst); this is the
# backstop. Its SIGTERM has gpu_check.py stop the running phase's processes and print its summary, well within the
# 10 s before the SIGKILL; 590 + 10 s keeps even that in 10 minutes.
exec timeout --kill-after=10 590 "$python" bench/gpu_check.py "$@"
