#!/usr/bin/env bash
# The settling kernel's block inside the round, A/B on one GPU (issue 25): tools/averaging_overhead.py
# at SETTLE_BLOCK 1024 and 4096, the out-of-place variant alone and after the in-place one, twice.
# Usage: COMMIT=<sha> tools/settle_ab.sh OUT; prints one row per case (own kernel, own, watched own, in us).
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 ELCHE_BENCH_COMMIT=${COMMIT:-}
out=$1
for pass in 1 2; do
for block in 1024 4096; do
for variants in out-of-place fused,out-of-place; do
  tag=b${block}-${variants/,/+}-p$pass
  python3 - "$block" "$variants" "$out/$tag.json" <<'PY' > "$out/$tag.log" 2>&1
import runpy, sys
from lightning_elche.planes import settle
block, variants, path = sys.argv[1:]
settle.SETTLE_BLOCK = int(block)
sys.argv = ["tools/averaging_overhead.py", "--iters", "100", "--variants", variants, "--out", path]
runpy.run_path("tools/averaging_overhead.py", run_name="__main__")
PY
  python3 -c "
import json,sys
r=json.load(open('$out/$tag.json'))
for k,v in r.items():
    if isinstance(v,dict) and 'own_kernel_us' in v: print('$tag', k, round(v['own_kernel_us'],1), round(1000*v['own_ms'],1), round(1000*v['watched_own_ms'],1))
" >> $out/ab.txt 2>&1
done; done; done
tar czf $out/ab-json.tgz $out/*.json $out/*.log 2>/dev/null; rm -f $out/b*.json $out/b*.log
cat $out/ab.txt
