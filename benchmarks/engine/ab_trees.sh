#!/usr/bin/env bash
# Decode and prefill of two (or three) source trees of hetmoe in ONE device call: each tree is
# built into its own folder (in parallel), then benchmarks/engine/decode_ab.py runs once per tree
# per round, alternating (old, new, old, new, ...), each process importing its tree's build.
#
# 1. Here (needs git), once per A/B: archives of the commits, without docs/ tests/ benchmarks/
#    (the benchmark script is this checkout's), into .ab/<label>/; .ab/ goes in .git/info/exclude.
#      bash benchmarks/engine/ab_trees.sh prepare old=98efd36 new=938dbea [head=HEAD]
# 2. On the device machine (carry [".ab"]; the first label is the baseline of the ratios):
#      bash benchmarks/engine/ab_trees.sh run
#    env (defaults): SHAPE=qwen3-30b-a3b FORMAT=int8 LAYERS= (the shape's) DEFERRED=0,3
#      TOKENS=200 (greedy tokens a run) BUDGETS=0 (GPU expert GB per decode row, or all: the GPU
#      side alone, free of the host's bandwidth noise) PREFILL=512,4096 (set empty: decode only)
#      PREFILL_MODES=gpu,cpu,auto CPU_MAX=512
#      ROUNDS=3 (at most; a round starts only if the last one fits before DEADLINE) DEADLINE=510
#      (s, whole script) JOBS= (build jobs per tree; default: cores / trees)
#    Output under $OUT (or /tmp/ab_out): <label>_<round>.json and .log per run, build logs,
#    ab_table.md and ab_summary.json (means per tree, ratios to the first; printed at the end).
#    DEADLINE keeps the call inside a 9-minute device command; with three trees fewer rounds fit.
# 3. Or one CPU MoE layer per tree (benchmarks/kernels/bench_cpu_moe.py), alternating the same way:
#      bash benchmarks/engine/ab_trees.sh cpu
#    env (defaults): BENCH_ARGS="--formats int4 --q 512,2048 --layers 4 --no-torch --no-crossover
#      --warmup-s 0.5" ROUNDS=2 DEADLINE=100 JOBS=; output <label>_cpu_<round>.json and .log, and
#      a table of ms per (format, q) per tree and round, the ratio to the first tree's mean.
#    AB_DIR (default .ab) names the archives' folder: A/Bs of different changes side by side.
set -uo pipefail
AB=${AB_DIR:-.ab}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }

prepare() {
  [ $# -ge 2 ] || { echo "prepare needs at least two label=commit pairs" >&2; exit 2; }
  grep -qx "/$AB/" .git/info/exclude 2>/dev/null || echo "/$AB/" >> .git/info/exclude
  rm -rf "$AB"; mkdir -p "$AB"
  for pair in "$@"; do
    label=${pair%%=*}; ref=${pair#*=}
    case $label in ''|*[!a-z0-9_]*) echo "label '$label': lowercase letters, digits, _" >&2
                                     exit 2;; esac
    commit=$(git rev-parse --verify "$ref^{commit}") || exit 2
    mkdir -p "$AB/$label"
    git archive "$commit" -- . ':!docs' ':!tests' ':!benchmarks' | tar -x -C "$AB/$label"
    echo "$label $commit" >> "$AB/trees.txt"
  done
  cat "$AB/trees.txt"; du -sh "$AB"
}

# An editable install of hetmoe puts an import hook ahead of PYTHONPATH: drop it, so each run
# imports the build of its tree (decode_ab.py also records the path it imported).
write_site() {
  mkdir -p "$1"
  cat > "$1/sitecustomize.py" <<'EOF'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
EOF
}

build_all() {  # $1: build jobs per tree
  local pids=() label
  for label in $LABELS; do
    ( CMAKE_BUILD_PARALLEL_LEVEL=$1 python3 -m pip install --no-deps --no-build-isolation -U \
        --no-index -q --target "$WORK/$label" -C build-dir="$WORK/build_$label" "$AB/$label" \
        > "$OUT/build_$label.log" 2>&1 ) &
    pids+=($!)
  done
  local ok=1 i=0
  for label in $LABELS; do
    wait "${pids[$i]}" || { ok=0; echo "build of $label failed:"
                            tail -30 "$OUT/build_$label.log"; }
    i=$((i + 1))
  done
  [ $ok = 1 ] || exit 1
  echo "== built $LABELS at $(el) s"
}

run_tree() {  # $1 label, $2 round
  PYTHONPATH="$WORK/site:$WORK/$1" HETMOE_CACHE_DIR="$WORK/cache" python3 -u \
    benchmarks/engine/decode_ab.py --shape "$SHAPE" --weight-format "$FORMAT" \
    ${LAYERS:+--num-layers "$LAYERS"} --deferred "$DEFERRED" --new-tokens "$TOKENS" \
    --repeats 1 --budgets "$BUDGETS" --prefill "$PREFILL" --prefill-modes "$PREFILL_MODES" \
    --cpu-max "$CPU_MAX" \
    --json "$OUT/${1}_$2.json" > "$OUT/${1}_$2.log" 2>&1 || echo "$1 round $2 failed:"
  tail -n 12 "$OUT/${1}_$2.log"
}

run() {
  [ -f "$AB/trees.txt" ] || { echo "no $AB/trees.txt: run 'prepare' here and carry .ab" >&2
                              exit 2; }
  SHAPE=${SHAPE:-qwen3-30b-a3b}; FORMAT=${FORMAT:-int8}; LAYERS=${LAYERS:-}
  DEFERRED=${DEFERRED:-0,3}; TOKENS=${TOKENS:-200}; PREFILL=${PREFILL-512,4096}
  BUDGETS=${BUDGETS:-0}
  PREFILL_MODES=${PREFILL_MODES:-gpu,cpu,auto}; CPU_MAX=${CPU_MAX:-512}
  ROUNDS=${ROUNDS:-3}; DEADLINE=${DEADLINE:-510}
  OUT=${OUT:-/tmp/ab_out}; WORK=/tmp/ab; mkdir -p "$OUT" "$WORK"
  LABELS=$(awk '{print $1}' "$AB/trees.txt" | tr '\n' ' ')
  local n; n=$(echo $LABELS | wc -w)
  cp "$AB/trees.txt" "$OUT/"
  write_site "$WORK/site"
  build_all "${JOBS:-$(( $(nproc) / n ))}"
  # The machine profile (prefill's auto mode) measured once, by the first tree, for all.
  local measure="import torch; from hetmoe.calibration import current
current(torch.device('cuda'), formats=('$FORMAT',))"
  PYTHONPATH="$WORK/site:$WORK/${LABELS%% *}" HETMOE_CACHE_DIR="$WORK/cache" python3 -c "$measure" \
    > "$OUT/calibrate.log" 2>&1 || { echo "calibration failed:"; tail -20 "$OUT/calibrate.log"; }
  echo "== machine profile at $(el) s"
  local round=1 start took=0 label
  while [ $round -le "$ROUNDS" ] && [ $(( $(el) + took )) -le "$DEADLINE" ]; do
    start=$(el)
    for label in $LABELS; do
      echo "== round $round, $label at $(el) s"
      run_tree "$label" "$round"
    done
    took=$(( $(el) - start )); round=$((round + 1))
  done
  echo "== $((round - 1)) rounds in $(el) s"
  PYTHONPATH=src python3 -m hetmoe.bench.tree_ab "$OUT" $LABELS
}

cpu() {
  [ -f "$AB/trees.txt" ] || { echo "no $AB/trees.txt: run 'prepare' here and carry .ab" >&2
                              exit 2; }
  BENCH_ARGS=${BENCH_ARGS:-"--formats int4 --q 512,2048 --layers 4 --no-torch --no-crossover
    --warmup-s 0.5"}
  ROUNDS=${ROUNDS:-2}; DEADLINE=${DEADLINE:-100}
  OUT=${OUT:-/tmp/ab_out}; WORK=/tmp/ab; mkdir -p "$OUT" "$WORK"
  LABELS=$(awk '{print $1}' "$AB/trees.txt" | tr '\n' ' ')
  local n round=1 start took=0 label; n=$(echo $LABELS | wc -w)
  cp "$AB/trees.txt" "$OUT/"
  write_site "$WORK/site"
  build_all "${JOBS:-$(( $(nproc) / n ))}"
  while [ $round -le "$ROUNDS" ] && [ $(( $(el) + took )) -le "$DEADLINE" ]; do
    start=$(el)
    for label in $LABELS; do
      echo "== round $round, $label at $(el) s"
      # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
      PYTHONPATH="$WORK/site:$WORK/$label" python3 -u benchmarks/kernels/bench_cpu_moe.py \
        $BENCH_ARGS --json "$OUT/${label}_cpu_$round.json" > "$OUT/${label}_cpu_$round.log" 2>&1 \
        || { echo "$label round $round failed:"; tail -n 20 "$OUT/${label}_cpu_$round.log"; }
    done
    took=$(( $(el) - start )); round=$((round + 1))
  done
  echo "== $((round - 1)) rounds in $(el) s"
  python3 - "$OUT" $LABELS <<'PY'
import json, statistics, sys
from pathlib import Path
out, labels = Path(sys.argv[1]), sys.argv[2:]
ms: dict[tuple[str, int], dict[str, list[float]]] = {}
for label in labels:
    for path in sorted(out.glob(f"{label}_cpu_*.json")):
        for row in json.loads(path.read_text())["rows"]:
            ms.setdefault((row["format"], row["q"]), {}).setdefault(label, []).append(row["ms"])
print("| format | q | " + " | ".join(f"{x} ms (rounds)" for x in labels)
      + f" | {labels[0]}'s mean ms over each other's (above 1: faster) |")
print("|---|---:|" + "---|" * len(labels) + "---|")
for (fmt, q), runs in sorted(ms.items()):
    means = {x: statistics.mean(runs[x]) for x in labels if runs.get(x)}
    cells = [", ".join(f"{v:.2f}" for v in runs.get(x, [])) for x in labels]
    ratios = ", ".join(f"{x} {means[labels[0]] / means[x]:.2f}x" for x in labels[1:]
                       if x in means and labels[0] in means)
    print(f"| {fmt} | {q} | " + " | ".join(cells) + f" | {ratios} |")
PY
}

case ${1:-} in
  prepare) shift; prepare "$@";;
  run) run;;
  cpu) cpu;;
  *) echo "usage: $0 prepare LABEL=COMMIT LABEL=COMMIT [LABEL=COMMIT] | $0 run | $0 cpu" >&2
     exit 2;;
esac
