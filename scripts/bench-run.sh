#!/usr/bin/env bash
# Benchmark of the single-process runner: prefill tok/s of a 512-token prompt and decode tok/s
# of 128 tokens after a short prompt, with N threads (default 2). Prints one line per case.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
./scripts/fetch-model.sh >/dev/null
cargo build --release -q -p duet-gpu-worker
bin=target/release/duet-gpu-worker
long=$(python3 -c 'import json; g=json.load(open("testdata/golden/greedy.json")); it=[i for i in g["items"] if i["kind"]=="raw_long"][0]; print(",".join(map(str, it["prompt_ids"][:512])))')
for case in "prefill-512:$long:1" "decode-128:504,3575,282,4649,314:128"; do
  IFS=: read -r name ids max <<<"$case"
  RUST_LOG=warn $bin --threads "$threads" run --prompt-ids "$ids" --max-tokens "$max" --json |
    python3 -c "import sys,json; t=json.load(sys.stdin)['timings']; k='prefill' if '$name'.startswith('prefill') else 'decode'; n=t['prompt_tokens'] if k=='prefill' else t['generated_tokens']; print('$name threads=$threads: %s %.1f tok/s over %d tokens' % (k, t[k+'_tokens_per_s'], n))"
done
