#!/usr/bin/env bash
# llama.cpp's llama-batched-bench on bench_batch.py's workload (NPL requests x (NPP prompt, NTG
# output), each its own prompt) on a random Qwen3-30B-A3B-shaped Q8_0 GGUF, on the device machine.
# The peer kit's prebuilt binary is llama-bench only, so llama-batched-bench is built from its
# source (.peers/lcpp_build.sh, about 4 minutes) while .peers/make_gguf.py writes the GGUF.
#
#   bash benchmarks/serving/batch_peer.sh            (carry .peers; see .peers/README.md)
#
# env (defaults): NPL=256 (or a list, 1,2,4,...,256: a row each) NPP=512 NTG=128 THREADS=15
#   UB=4096 (prefill ubatch: llama.cpp copies the experts to the GPU once per ubatch)
#   NCMOE= (empty: every routed expert on the CPU with -ot exps=CPU; N: -ncmoe N, the experts
#   of all but N layers on the GPU: 24 is ~15 GB)
#   LAYERS=48 TYPE=q8_0 EXTRA= (more llama-batched-bench args) DEADLINE=560 (s, whole script)
#   READY= (a file touched once built and the GGUF written, or on failure: another program may
#   start timing) AFTER= (a file to wait for before timing: another program's timed work done)
#   DEST=/tmp/llama.cpp (the build)
# Output: llama-batched-bench's markdown table on stdout (S_TG: output tok/s; T: job seconds),
# also saved as batched_bench.md beside the logs in $OUT (default /tmp/peer_logs); rows of a
# run cut by DEADLINE stay (bench_serve.py --plot --peer reads it).
set -uo pipefail
PEERS=${PEERS:-$(pwd)/.peers}
NPL=${NPL:-256}; NPP=${NPP:-512}; NTG=${NTG:-128}; THREADS=${THREADS:-15}; UB=${UB:-4096}
NCMOE=${NCMOE:-}; LAYERS=${LAYERS:-48}; TYPE=${TYPE:-q8_0}; EXTRA=${EXTRA:-}
DEADLINE=${DEADLINE:-560}; READY=${READY:-}; AFTER=${AFTER:-}
DEST=${DEST:-/tmp/llama.cpp}; LOG=${OUT:-/tmp/peer_logs}; mkdir -p "$LOG"
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
ready() { [ -z "$READY" ] || touch "$READY"; }
trap ready EXIT
[ -f "$PEERS/lcpp/src.tar.gz" ] || { echo "no $PEERS/lcpp/src.tar.gz: carry .peers"; exit 1; }

shm=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
dir=/tmp; [ -n "$shm" ] && [ "$shm" -gt 36 ] && dir=/dev/shm
GGUF=${GGUF:-$dir/peer_${LAYERS}L_${TYPE}.gguf}

if [ -x "$DEST/build/bin/llama-batched-bench" ]; then
  echo "== llama-batched-bench already built (a warm machine)"; build_pid=
else
  ( TARGETS=llama-batched-bench bash "$PEERS/lcpp_build.sh" "$PEERS/lcpp/src.tar.gz" "$DEST" \
      > "$LOG/build.txt" 2>&1 ) &
  build_pid=$!
fi
TREE=/tmp/peer_gguf_tree; rm -rf "$TREE"; mkdir -p "$TREE"
tar -xzf "$PEERS/lcpp/src.tar.gz" -C "$TREE" llama.cpp/gguf-py llama.cpp/models/ggml-vocab-qwen2.gguf
if [ -f "$GGUF" ]; then
  echo "== reusing $GGUF"
else
  nice -n 5 python3 -u "$PEERS/make_gguf.py" --llama-cpp "$TREE/llama.cpp" --layers "$LAYERS" \
    --type "$TYPE" --threads 4 -o "$GGUF" > "$LOG/gguf.txt" 2>&1 \
    || { echo "make_gguf failed:"; tail -5 "$LOG/gguf.txt"; rm -f "$GGUF"; exit 1; }
  echo "== GGUF written at $(el)s: $GGUF"
fi
if [ -n "$build_pid" ]; then
  wait "$build_pid"; tail -1 "$LOG/build.txt"
  grep -q BUILD_OK "$LOG/build.txt" || { tail -20 "$LOG/build.txt"; exit 1; }
fi
echo "== built at $(el)s"
ready
if [ -n "$AFTER" ]; then
  while [ ! -e "$AFTER" ] && [ "$(el)" -lt "$DEADLINE" ]; do sleep 1; done
  echo "== $AFTER at $(el)s"
fi

if [ -n "$NCMOE" ]; then PLACE=(-ncmoe "$NCMOE"); else PLACE=(-ot exps=CPU); fi
npl_max=$(tr ',' '\n' <<< "$NPL" | sort -n | tail -1)
ARGS=(-m "$GGUF" -ngl 99 "${PLACE[@]}" -t "$THREADS" -c $(( npl_max * (NPP + NTG) ))
      -b "$UB" -ub "$UB" -npp "$NPP" -ntg "$NTG" -npl "$NPL")
left=$(( DEADLINE - $(el) ))
echo "+ llama-batched-bench ${ARGS[*]} $EXTRA   (${left}s left)"
[ "$left" -ge 10 ] || { echo "no time left for llama-batched-bench (DEADLINE=$DEADLINE)"; exit 1; }
# shellcheck disable=SC1091
source "$DEST/build/env.sh"
# shellcheck disable=SC2086
timeout -s INT "$left" "$DEST/build/bin/llama-batched-bench" "${ARGS[@]}" $EXTRA \
  2> "$LOG/batched_bench.log" | tee "$LOG/batched_bench.md"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { echo "llama-batched-bench rc=$rc at $(el)s"; tail -20 "$LOG/batched_bench.log"; }
echo "== done at $(el)s"
