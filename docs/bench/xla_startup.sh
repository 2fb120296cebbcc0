#!/usr/bin/env bash
# Start-up on --device xla, one engine per fresh process (docs/benchmarks.md, "Start-up on XLA").
# Usage: KINDS="extras-off extras-on extras-off extras-on" bash docs/bench/xla_startup.sh [json-model dir]
# (the ngram-grammar kind needs the grammar tests' model: tests/support/grammar_model.py write_json_model,
# num_hidden_layers=1).
cd "$(dirname "$0")/../.."
V="$(bash .ci/xla-env | tail -n 1)"
for kind in ${KINDS:-extras-off extras-on extras-off extras-on}; do
  echo "== $kind $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  env PJRT_DEVICE=CPU XLA_PERSISTENT_CACHE_PATH="$V/compile-cache" "$V/bin/python" docs/bench/xla_startup.py "$kind" "${1:-}" 2>/dev/null | grep '^{'
done
echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
