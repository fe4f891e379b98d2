#!/usr/bin/env bash
# Keeps one GPU study call's outputs under benchmarks/results/: the run directories from
# study_ENGINE_TAG.tar.gz (requests.jsonl and step_log.jsonl gzipped: `conveyor report` and
# `conveyor bench calibrate` read the .gz), the GPU memory samples and the study's log.
#   bash benchmarks/gpu/keep_study.sh FILES_AT ENGINE TAG DEST   # e.g. ... sustained_h200 s2 benchmarks/results/gpu-study-s2/h200
set -euo pipefail
src=$1; engine=$2; tag=$3; dest=$4
mkdir -p "$dest"
tar -C "$dest" --strip-components=1 -xzf "$src/study_${engine}_$tag.tar.gz"
cp "$src/nvsmi_${engine}_$tag.csv" "$dest/nvsmi.csv"; cp "$src/study_${engine}_$tag.log" "$dest/study.log"
find "$dest" \( -name requests.jsonl -o -name step_log.jsonl \) -exec gzip -9 -f {} \;
rm -rf "$dest/report"
du -sh "$dest"
