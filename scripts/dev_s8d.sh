#!/bin/bash
# temporary device script (session 8), deleted after use
export PYTHONPATH=. PYTHONUNBUFFERED=1
G=tgraph.kernels.triton.gemv
OLD="$G._M1_WIDE_K=1000000000 $G._M1_MIN_PROGRAMS_PER_SM=0"
for p in llama-3.2-1b qwen2.5-0.5b llama-3-8b; do
  echo "== $p b1: A new M=1 rule, B old"; timeout 150 python -m tgraph.bench.ab $p --batch 1 --rounds 3 --set $OLD 2>&1 | tail -6
done
timeout 60 python -m tgraph.bench.tune_gemv $OUT/lmhead.json --m 1 --fusion plain --shapes 128256:2048 --widths 4,8 --block-k 1024,2048 --warps 4,8 --stages 3 --splits 1 2>&1 | grep -v "^  "
python3 -c "
import json
for r in json.load(open('$OUT/lmhead.json')):
  print(r['N'], r['K'], 'current', r['current_cfg'], round(r['current']*1e3,2), [(c, round(t*1e3,2)) for c, t in r['candidates']])"
timeout 90 python -m tgraph.bench.profile qwen2.5-0.5b --batch 1 --timeline > $OUT/tl-qwen-b1.txt 2>&1; grep -A 12 "step:" $OUT/tl-qwen-b1.txt; tail -6 $OUT/tl-qwen-b1.txt
