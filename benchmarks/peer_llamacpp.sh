#!/usr/bin/env bash
# k3 beside llama.cpp on one checkpoint: resident decode, same prompt ids, greedy, same
# thread count, reps interleaved (docs/PERFORMANCE.md "Beside llama.cpp").
#
#   benchmarks/peer_llamacpp.sh PEERS_DIR LLAMA_DIR GGUF MODEL [REPS]
#
# PEERS_DIR holds llamacpp_run.sh (the project's shared peers folder; its README says how
# to build llama.cpp and convert a `k3 synth` checkpoint to GGUF). Per rep and arm: the
# mean of decode steps 8..GEN-1 (every expert read in, pages cached), the mean of steps
# 1..GEN-1, the ids. One TSV row each to benchmarks/results/peer-llamacpp.tsv with the
# CPU flags and the load. Environment: IDS (default the ladder prompt), GEN (16), THREADS (2).
set -euo pipefail
PEERS=$1; LLAMA=$2; GGUF=$3; MODEL=$4; REPS=${5:-3}
IDS=${IDS:-1008,104,318,1538,387}; GEN=${GEN:-16}; THREADS=${THREADS:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
K3=${K3:-$ROOT/.venv/bin/k3}
TSV=$ROOT/benchmarks/results/peer-llamacpp.tsv
RUN=$(date +%Y%m%dT%H%M%S)
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|fma|avx512f|avx512bw|avx512_bf16|avx512_vnni|amx_bf16' | tr '\n' ' ')
[ -s "$TSV" ] || printf 'run\tarm\trep\tmodel\tthreads\twarm_s_tok\tdecode_s_tok\tids\tload1\tcpu\n' > "$TSV"
W=$(mktemp -d)
for rep in $(seq 1 "$REPS"); do
  load=$(cut -d' ' -f1 /proc/loadavg)
  IDS=$IDS GEN=$GEN THREADS=$THREADS OUT_DIR=$W/ll$rep bash "$PEERS/llamacpp_run.sh" "$LLAMA" "$GGUF" > "$W/ll$rep.out" 2>&1
  read -r warm dec ids < <(awk '/^STEP/ {s[$2]=$5; t[$2]=$4} END {for (i in s) {if (i>=8) {w+=s[i]; nw++} if (i>=1) {d+=s[i]; nd++}}
      for (i=0; i in t; i++) o=o (i ? "," : "") t[i]; printf "%.4f %.4f %s\n", w/nw, d/nd, o}' "$W/ll$rep/llama.log")
  printf '%s\tllama.cpp\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$RUN" "$rep" "$GGUF" "$THREADS" "$warm" "$dec" "$ids" "$load" "$FLAGS" >> "$TSV"
  echo "llama.cpp rep $rep: steps 8+ $warm s/token, steps 1+ $dec, ids $ids"
  load=$(cut -d' ' -f1 /proc/loadavg)
  "$K3" run "$MODEL" --ids "$IDS" --gen "$GEN" --greedy --threads "$THREADS" --out "$W/k3.json" > /dev/null 2>&1
  read -r warm dec ids < <(python3 -c "
import json, statistics as s; d = json.load(open('$W/k3.json')); st = d['step_seconds']
print('%.4f %.4f %s' % (s.fmean(st[8:]), s.fmean(st[1:]), ','.join(map(str, d['generated_ids']))))")
  printf '%s\tk3\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$RUN" "$rep" "$MODEL" "$THREADS" "$warm" "$dec" "$ids" "$load" "$FLAGS" >> "$TSV"
  echo "k3        rep $rep: steps 8+ $warm s/token, steps 1+ $dec, ids $ids"
done
rm -rf "$W"
