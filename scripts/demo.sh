#!/usr/bin/env bash
# The main job in one command: install what is needed, start the server with a default room
# (digits, star topology, WebSocket links) and two native ranks, and print the URL a person
# opens to join from a browser. Ctrl-C stops everything (the leader publishes, a checkpoint stays).
# Env: PORT (default 8080), HOST (listen address, default 127.0.0.1; 0.0.0.0 to let other
# machines on the LAN join), RANKS (native ranks, default 2), STEPS (0 = until Ctrl-C).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
PY="${PYTHON:-python3}"
PORT="${PORT:-8080}"
HOST="${HOST:-127.0.0.1}"
RANKS="${RANKS:-2}"
STEPS="${STEPS:-0}"
CKPT="${CKPT:-.cache/checkpoints}"
mkdir -p "$CKPT"
pids=()
cleanup() {
  trap - INT TERM EXIT
  echo "[demo] stopping" >&2
  # SIGTERM: a non-interactive shell starts background jobs with SIGINT ignored; the server
  # and the ranks stop gracefully on either
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait || true
}
trap cleanup INT TERM EXIT
"$PY" -m tabcohort serve --host "$HOST" --port "$PORT" --room digits --dataset digits \
  --steps "$STEPS" --checkpoint-dir "$CKPT" &
pids+=($!)
url="http://127.0.0.1:$PORT"
for _ in $(seq 1 100); do   # wait (bounded: 20 s) until the server answers
  if "$PY" -c "import urllib.request,sys; urllib.request.urlopen('$url/healthz', timeout=1)" 2>/dev/null; then break; fi
  sleep 0.2
done
rank_pids=()
for i in $(seq 1 "$RANKS"); do
  # (a process substitution, not a pipe, so that $! is the rank itself, not sed)
  "$PY" -m tabcohort rank --server "$url" --room digits > >(sed -u "s/^/[rank $i] /") 2>&1 &
  pids+=($!)
  rank_pids+=($!)
done
echo
echo "  Open $url/ in a browser to join the cohort from a tab."
echo "  Operator view: $url/operator   metrics: $url/metrics"
echo
if [ "$STEPS" != 0 ]; then
  wait "${rank_pids[@]}" || true      # the room stops at STEPS; the ranks exit; then so do we
  echo "[demo] the room reached its step limit; the final checkpoint is in $CKPT"
else
  wait
fi
