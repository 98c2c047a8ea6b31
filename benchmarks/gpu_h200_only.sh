#!/usr/bin/env bash
# Run `benchmarks/$1` only on an H200 (the issue-24 bars' machine): on any other GPU print its
# name and stop at once, so a try that gets another card costs only the machine's start.
set -u
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in
    *H200*) shift_script="$1"; shift; exec bash "benchmarks/$shift_script" "$@" ;;
    *) echo "not an H200 ($name): nothing run"; exit 0 ;;
esac
