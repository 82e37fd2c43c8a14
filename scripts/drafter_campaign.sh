#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The drafter training campaign in the background, across sessions (issue 47).
#
#   bash scripts/drafter_campaign.sh start STAGE [args]  # python -m vllm_ddtree.drafter STAGE
#                                                        # (data, train, all, ...)
#   bash scripts/drafter_campaign.sh sweep LR [LR ...]    # short runs on the same features
#                                   # (SWEEP_STEPS, default 300), sweep/lr-LR/train_log.jsonl
#   bash scripts/drafter_campaign.sh pipeline LR [LR ...]  # all of it, unattended:
#                                   # data, the sweep, train at the sweep's best LR
#                                   # (highest final val_tau_chain), export to
#                                   # WORKDIR/export; every part resumes from disk
#   bash scripts/drafter_campaign.sh session ROUND [LR [TRAIN OPTIONS]]  # one round:
#                                   # features of the ROUND-th block of SESSION_SEQS
#                                   # sequences (default 2500), SESSION_STEPS steps
#                                   # (default 1500, WSD decay over the last third) from
#                                   # INIT (default: the committed drafter), export to
#                                   # WORKDIR/round-ROUND/export, then the vLLM replay
#   bash scripts/drafter_campaign.sh continue ROUND  # a round stopped midway (a session
#                                   # ended): its training from the newest checkpoint with
#                                   # the options in its train_config.json, then export and
#                                   # the vLLM replay
#   bash scripts/drafter_campaign.sh pause     # SIGSTOP: before the suite or any timing
#   bash scripts/drafter_campaign.sh resume    # SIGCONT
#   bash scripts/drafter_campaign.sh status    # stage, progress, last held-out numbers
#   bash scripts/drafter_campaign.sh stop      # SIGTERM; 'start' again resumes from disk
#
# Every stage resumes from what is on disk (generations, features, the newest
# checkpoint with its optimizer and data-order state), so stop/start loses at most
# one checkpoint interval. Runs at nice 19 with a bounded vLLM KV cache
# (VLLM_CPU_KVCACHE_SPACE, GiB: vLLM's CPU default takes most of the memory).
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR="${DRAFTER_WORKDIR:-$HOME/.cache/vllm-ddtree/drafter-work-v3}"
PIDFILE="$WORKDIR/campaign.pid"
LOG="$WORKDIR/campaign.log"
mkdir -p "$WORKDIR"

pid() { [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null && cat "$PIDFILE"; }

case "${1:-status}" in
  start)
    stage="${2:?start needs a stage: data, train, all, ...}"
    shift 2
    if p=$(pid); then echo "already running (pid $p)"; exit 0; fi
    # setsid: its own process group, so pause/resume/stop reach every child.
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-3}" setsid nohup nice -n 19 \
      .venv/bin/python -m vllm_ddtree.drafter "$stage" --workdir "$WORKDIR" "$@" \
      >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    echo "started (pid $!), log $LOG"
    ;;
  sweep|pipeline)
    cmd=$1
    shift
    [[ $# -ge 1 ]] || { echo "$cmd needs learning rates" >&2; exit 2; }
    if p=$(pid); then echo "already running (pid $p)"; exit 0; fi
    [[ $cmd == pipeline || -f "$WORKDIR/index.json" ]] || {
      echo "no features yet: start data first" >&2; exit 2; }
    steps="${SWEEP_STEPS:-300}"
    py=".venv/bin/python -m vllm_ddtree.drafter"
    runs="set -e; "
    [[ $cmd == pipeline ]] && runs+="$py data --workdir '$WORKDIR'; "
    for lr in "$@"; do
      d="$WORKDIR/sweep/lr-$lr"
      mkdir -p "$d"
      runs+="for f in features.bin tokens.bin topk_ids.bin topk_logprobs.bin index.json \
generations.jsonl; do ln -sf '$WORKDIR'/\$f '$d'/\$f; done; "
      runs+="$py train --workdir '$d' --lr $lr --steps $steps --decay-steps $((steps / 3)) \
--eval-every 50 --ckpt-every 50; "
    done
    if [[ $cmd == pipeline ]]; then
      # The sweep's best: the highest held-out chain tau at its last evaluation.
      runs+="lr=\$(.venv/bin/python scripts/drafter_sweep_best.py '$WORKDIR/sweep'); "
      runs+="echo \$lr >'$WORKDIR/sweep/chosen_lr'; "
      runs+="$py train --workdir '$WORKDIR' --lr \$lr; "
      runs+="$py export --workdir '$WORKDIR' --lr \$lr --export-dir '$WORKDIR/export'; "
    fi
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-3}" setsid nohup nice -n 19 \
      bash -c "$runs" >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    echo "$cmd started (pid $!): $*; log $LOG"
    ;;
  session)
    # Machines here do not keep ~/.cache from one session to the next: a round fits
    # one session (features ~1 s per sequence, a step ~3 s on 2 cores) and goes on
    # from the committed drafter; its export is committed when vLLM accepts it more.
    round="${2:?session needs a round number}"
    lr="${3:-3e-4}"
    shift $(( $# < 3 ? $# : 3 ))
    extra="$*"  # more training options, e.g. --autocast none
    if p=$(pid); then echo "already running (pid $p)"; exit 0; fi
    d="$WORKDIR/round-$round"
    seqs="${SESSION_SEQS:-2500}"
    steps="${SESSION_STEPS:-1500}"
    init="${INIT:-vllm_ddtree/drafter/smollm2_135m}"
    py=".venv/bin/python -m vllm_ddtree.drafter"
    runs="set -e; $py data --workdir '$d' --max-sequences $seqs --data-round $round; "
    runs+="$py train --workdir '$d' --init-from '$init' --lr $lr --steps $steps \
--decay-steps $((steps / 3)) --eval-every 100 $extra; "
    runs+="$py export --workdir '$d' --init-from '$init' --lr $lr --steps $steps \
--decay-steps $((steps / 3)) --export-dir '$d/export' $extra; "
    runs+=".venv/bin/python -m vllm_ddtree.drafter.replay --checkpoint '$d/export' \
--out '$d/replay'; "
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-3}" setsid nohup nice -n 19 \
      bash -c "$runs" >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    echo "session round $round started (pid $!): $seqs sequences, $steps steps at lr $lr \
from $init; log $LOG"
    ;;
  continue)
    round="${2:?continue needs a round number}"
    if p=$(pid); then echo "already running (pid $p)"; exit 0; fi
    d="$WORKDIR/round-$round"
    [[ -f "$d/train_config.json" ]] || { echo "no $d/train_config.json: start the round \
with 'session $round' first" >&2; exit 2; }
    # The round's own options, so the resumed run trains on the same schedule
    # (export too: every stage rewrites train_config.json from its options).
    opts=$(.venv/bin/python -c "
import json, shlex, sys
c = json.load(open(sys.argv[1]))
args = ['--lr', c['lr'], '--steps', c['steps'], '--decay-steps', c['decay_steps'],
        '--autocast', c['autocast'], '--seed', c['seed'], '--eval-every', c['eval_every']]
if c.get('init_from'):
    args += ['--init-from', c['init_from']]
print(' '.join(shlex.quote(str(a)) for a in args))
" "$d/train_config.json")
    py=".venv/bin/python -m vllm_ddtree.drafter"
    runs="set -e; $py train --workdir '$d' $opts; "
    runs+="$py export --workdir '$d' $opts --export-dir '$d/export'; "
    runs+=".venv/bin/python -m vllm_ddtree.drafter.replay --checkpoint '$d/export' \
--out '$d/replay'; "
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-3}" setsid nohup nice -n 19 \
      bash -c "$runs" >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    echo "continue round $round (pid $!): $opts; log $LOG"
    ;;
  pause|resume|stop)
    p=$(pid) || { echo "not running"; exit 0; }
    sig=$([[ $1 == pause ]] && echo STOP || ([[ $1 == resume ]] && echo CONT || echo TERM))
    [[ $1 == stop ]] && kill -CONT -- "-$p" 2>/dev/null || true
    kill -"$sig" -- "-$p"
    echo "$1: sent SIG$sig to process group $p"
    ;;
  status)
    if p=$(pid); then
      echo "running (pid $p, state $(ps -o stat= -p "$p" | tr -d ' '))"
    else
      echo "not running"
    fi
    for w in "$WORKDIR" "$WORKDIR"/round-*; do
      [[ -d "$w" ]] || continue
      [[ $w == "$WORKDIR" ]] || echo "== $(basename "$w")"
      [[ -f "$w/generations.jsonl" ]] && \
        echo "generations: $(wc -l <"$w/generations.jsonl") prompts done"
      [[ -f "$w/index.json" ]] && .venv/bin/python -c "
import json, sys; i = json.load(open(sys.argv[1]))
print(f'features: {len(i[\"ids\"])} sequences, {i[\"offsets\"][-1] + i[\"lengths\"][-1] if i[\"ids\"] else 0:,} tokens')
" "$w/index.json"
      if [[ -f "$w/train_log.jsonl" ]]; then
        tail -n 1 "$w/train_log.jsonl" | cut -c1-200
        grep val_tau "$w/train_log.jsonl" | tail -n 1 | cut -c1-300
      fi
    done
    [[ -f "$WORKDIR/sweep/chosen_lr" ]] && echo "sweep chose lr $(cat "$WORKDIR/sweep/chosen_lr")"
    for log in "$WORKDIR"/sweep/*/train_log.jsonl; do
      [[ -f "$log" ]] || continue
      echo "sweep $(basename "$(dirname "$log")"): $(grep val_tau "$log" | tail -n 1 | cut -c1-200)"
    done
    ;;
  *) echo "usage: $0 start|sweep|pipeline|session|continue|pause|resume|status|stop" >&2; exit 2 ;;
esac
