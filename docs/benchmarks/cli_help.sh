#!/bin/bash
# Time and peak RSS of `dp-platform [CMD] --help` (median of 3 runs), as a Markdown table.
# Run from the repository root with the venv built: bash docs/benchmarks/cli_help.sh
set -u
for c in "" train sweep federated audit ingest ledger ui bench stack submit status logs stop; do
  ts=(); ms=()
  for i in 1 2 3; do
    /usr/bin/time -o /tmp/cli_help_time.$$ -f "%e %M" .venv/bin/dp-platform $c --help >/dev/null 2>&1
    out=$(tail -1 /tmp/cli_help_time.$$); ts+=("${out% *}"); ms+=("${out#* }")
  done
  t=$(printf "%s\n" "${ts[@]}" | sort -n | sed -n 2p); m=$(printf "%s\n" "${ms[@]}" | sort -n | sed -n 2p)
  printf "| %-28s | %5s | %5d |\n" "dp-platform ${c:+$c }--help" "$t" $((m / 1024))
done
rm -f /tmp/cli_help_time.$$
