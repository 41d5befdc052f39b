#!/usr/bin/env bash
# The main job in one command: install what the product needs (quietly; the log goes to
# .cache/install.log), start the server with a default room (digits, star topology, WebSocket
# links) and two native ranks, and print the URL a person opens to join from a browser.
# Ctrl-C stops in order: the ranks stop, the leader uploads the final checkpoint, then the
# server exits (at most ~10 s; Ctrl-C again stops at once).
# Settings (environment):
#   PORT    listen port, 1..65535 (default 8080; not 0: the ranks need a fixed one)
#   HOST    listen address (default 127.0.0.1; 0.0.0.0 lets other machines on the LAN join)
#   RANKS   native ranks to start (default 2; 0 = tabs only, and then any rank may lead:
#           serve --any-rank-may-lead, for a group that trusts itself)
#   STEPS   stop the room at exactly this step (default 0 = until Ctrl-C)
#   CKPT    checkpoint directory (default .cache/checkpoints; the room's newest checkpoint is
#           digits.ckpt, its history digits.history/, the trainer token .trainer-token)
#   FRESH   1 (default): start from scratch, deleting the demo room's old checkpoint;
#           0: resume from it (the page and the operator view say "resumed from step N")
#   INSTALL 1 (default): run scripts/install.sh first; 0: skip it
#   PYTHON  the interpreter, Python 3.11+ (default python3)
#   SERVER_WAIT  seconds to wait for the server to answer before the demo gives up (default 20;
#           at least 1: more on a slow machine, less in tests)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
PORT="${PORT:-8080}"
HOST="${HOST:-127.0.0.1}"
RANKS="${RANKS:-2}"
STEPS="${STEPS:-0}"
CKPT="${CKPT:-.cache/checkpoints}"
FRESH="${FRESH:-1}"
INSTALL="${INSTALL:-1}"
SERVER_WAIT="${SERVER_WAIT:-20}"
for v in PORT RANKS STEPS SERVER_WAIT; do
  if ! [[ "${!v}" =~ ^[0-9]+$ ]]; then echo "[demo] $v='${!v}': expected a whole number" >&2; exit 2; fi
  # (PORT=08091 ended in a Python SyntaxError and skipped the port-in-use check; PORT=0080 ran on 80)
  if [[ "${!v}" =~ ^0[0-9] ]]; then echo "[demo] $v='${!v}': write it without leading zeros" >&2; exit 2; fi
done
# (PORT=0 hung: serve bound a free port, the ranks dialled port 0; PORT=70000 ended in a traceback)
if [ "$PORT" -eq 0 ] 2>/dev/null; then
  echo "[demo] PORT=0: the demo needs a fixed port (its ranks and the URL it prints use it); choose one, e.g. PORT=8081" >&2
  exit 2
fi
if [ ${#PORT} -gt 5 ] || [ "$PORT" -gt 65535 ]; then
  echo "[demo] PORT=$PORT: expected a port in 1..65535" >&2; exit 2
fi
if [ "$SERVER_WAIT" -lt 1 ]; then echo "[demo] SERVER_WAIT=$SERVER_WAIT: expected at least 1 (seconds)" >&2; exit 2; fi
for v in FRESH INSTALL; do
  if [ "${!v}" != 0 ] && [ "${!v}" != 1 ]; then echo "[demo] $v='${!v}': expected 1 or 0" >&2; exit 2; fi
done
# the interpreter, before anything is deleted or started (PYTHON=nonexistent removed the previous
# run's checkpoint, then failed with shell errors)
if ! command -v "$PY" > /dev/null 2>&1; then
  echo "[demo] PYTHON=$PY: no such command; set PYTHON to a Python 3.11+ interpreter (default python3)" >&2
  exit 2
fi
if [ "$("$PY" -c 'import sys; print(sys.version_info >= (3, 11))' 2> /dev/null)" != True ]; then
  said="$("$PY" --version 2>&1 | head -n 1 || true)"
  echo "[demo] PYTHON=$PY: not a Python 3.11+ interpreter${said:+ ($said)}" >&2
  exit 2
fi
# the listen address, before anything is deleted (HOST=999.9.9.9 removed the previous run's
# checkpoint, then the server refused the address): one of its addresses must bind here
# (bounded: a resolver that does not answer)
if ! timeout 15 "$PY" -c '
import socket, sys
for fam, kind, proto, _, addr in socket.getaddrinfo(sys.argv[1], 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
    try:
        with socket.socket(fam, kind, proto) as s:
            s.bind(addr)
        sys.exit(0)
    except OSError:
        pass
sys.exit(1)' "$HOST" > /dev/null 2>&1; then
  echo "[demo] HOST=$HOST: not an address this machine can listen on; give one of its addresses (default 127.0.0.1; 0.0.0.0: every interface)" >&2
  exit 2
fi
# another process on the port would answer the health check below for this demo's server (which
# then fails to listen), and the ranks would join that one
if "$PY" -c "import socket, sys; s = socket.socket(); s.settimeout(1); sys.exit(0 if s.connect_ex(('127.0.0.1', $PORT)) == 0 else 1)"; then
  echo "[demo] PORT=$PORT: something already listens on 127.0.0.1:$PORT (another demo or serve?); stop it or choose another PORT" >&2
  exit 1
fi
if ! mkdir -p .cache "$CKPT" 2> /dev/null || [ ! -w "$CKPT" ]; then
  echo "[demo] CKPT=$CKPT: cannot create or write this directory; give CKPT a writable one (default .cache/checkpoints)" >&2
  exit 2
fi
if [ "$INSTALL" = 1 ]; then
  echo "[demo] installing (pip, npm; log: .cache/install.log)..."
  if ! bash scripts/install.sh > .cache/install.log 2>&1; then
    tail -n 20 .cache/install.log >&2
    echo "[demo] install failed; the full log is .cache/install.log" >&2
    exit 1
  fi
  grep '^\[install\] note' .cache/install.log || true
fi
if ! "$PY" -c 'import tabcohort, tabcohort_server' > /dev/null 2>&1; then   # (before a checkpoint is deleted)
  echo "[demo] PYTHON=$PY cannot import tabcohort: run scripts/install.sh (or the demo without INSTALL=0)" >&2
  exit 1
fi
# another server (a second demo from this checkout) on the checkpoint directory: its checkpoint
# was deleted below before this demo's server refused the directory (a new-user trial)
if ! held="$("$PY" -c '
import sys
from tabcohort.errors import ConfigError
from tabcohort_server.serve import lock_checkpoint_dir
try:
    lock_checkpoint_dir(sys.argv[1]).close()
except ConfigError as e:
    print(e.reason)
    sys.exit(1)' "$CKPT" 2>&1)"; then
  echo "[demo] CKPT=$CKPT: ${held:-cannot be locked} (another demo?); stop it, or give this one another CKPT and PORT" >&2
  exit 1
fi
resumed_step=   # the step of the checkpoint the room resumes from (FRESH=0)
if [ -f "$CKPT/digits.ckpt" ]; then
  if [ "$FRESH" = 1 ]; then
    rm -rf "$CKPT/digits.ckpt" "$CKPT/digits.history"
    echo "[demo] fresh start: removed the previous run's checkpoint (FRESH=0 resumes from it)"
  else
    resumed_step="$("$PY" - "$CKPT" <<'PY' || true
import sys
from tabcohort_server import checkpoint as ck
got = ck.load(sys.argv[1], "digits")
print("" if got is None else got[0]["step"])
PY
)"
    echo "[demo] resuming from $CKPT/digits.ckpt${resumed_step:+ (step $resumed_step)} (FRESH=1 starts from scratch)"
  fi
fi
pids=() rank_pids=() server_pid= up=0
alive() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
wait_bounded() {  # wait_bounded SECONDS PID...: until every PID exited, at most SECONDS
  local end=$(( $(date +%s) + $1 )); shift
  while alive "$@" && [ "$(date +%s)" -lt "$end" ]; do sleep 0.1; done
}
report_checkpoint() {
  "$PY" - "$CKPT" <<'PY' || true
import sys
from tabcohort_server import checkpoint as ck
got = ck.load(sys.argv[1], "digits")
if got is None:
    print(f"[demo] no checkpoint was stored in {sys.argv[1]}")
else:
    m = got[0]
    acc = m.get("accuracy")
    print(f"[demo] {'final' if m.get('final') else 'periodic'} checkpoint: step {m['step']}, "
          f"accuracy {'n/a' if acc is None else f'{acc * 100:.1f} %'}, in {ck.path_for(sys.argv[1], 'digits')}")
PY
}
cleanup() {   # cleanup INT|TERM|HUP|PIPE|EXIT: what ended the demo
  trap - TERM HUP EXIT
  # its output closed (`demo.sh | head`, a closed terminal): what it writes now is lost, and the
  # server and ranks must still be stopped (a SIGPIPE killed the demo and left its server running)
  trap '' PIPE
  set +e   # (an echo that fails on a closed output must not end the cleanup: set -e did)
  [ "${1:-EXIT}" = PIPE ] && exec > /dev/null   # (nobody reads it now)
  # a second Ctrl-C reaches the server and the ranks too, which stop at once; the demo itself
  # goes on to its summary (a second Ctrl-C killed it, and the checkpoint's line was lost)
  trap '' INT
  # (the ranks' part only while one runs: after a room that had nothing to train, or whose ranks
  # had already stopped at STEPS, it told of an upload that never came)
  if { [ ${#rank_pids[@]} -gt 0 ] && alive "${rank_pids[@]}"; } || { [ "$RANKS" = 0 ] && [ "$up" = 1 ]; }; then
    echo "[demo] stopping: the ranks finish, the leader uploads the final checkpoint, then the server exits"
  else
    echo "[demo] stopping the server"
  fi
  # SIGTERM: a non-interactive shell starts background jobs with SIGINT ignored (a Ctrl-C at the
  # terminal reaches them anyway: they handle it as a stop); the ranks go first, the server waits
  # (bounded) for them, then it is told too
  [ ${#rank_pids[@]} -gt 0 ] && kill -TERM "${rank_pids[@]}" 2>/dev/null || true
  [ ${#rank_pids[@]} -gt 0 ] && wait_bounded 20 "${rank_pids[@]}"
  if [ -n "$server_pid" ]; then
    # the server's SIGINT is its ordered stop: its tabs are told to stop and their leader uploads
    # the final checkpoint (SIGTERM would close their sockets at once). A terminal's Ctrl-C already
    # sent it one, and a second signal stops it at once: with tabs only (RANKS=0) that lost the
    # final checkpoint (a new-user trial). So it is signalled only when the demo ended otherwise.
    # Before it answered, it had no handler yet (a background job of this script starts with
    # SIGINT ignored): the terminal's Ctrl-C was lost on it, and no rank was started, so there
    # is nothing to drain: SIGTERM at once (the demo waited 15 s, then said the server was ready).
    if [ "$up" = 0 ]; then
      kill -TERM "$server_pid" 2>/dev/null || true
    else
      [ "${1:-EXIT}" = INT ] || kill -INT "$server_pid" 2>/dev/null || true
    fi
    wait_bounded 15 "$server_pid"
    kill -TERM "$server_pid" 2>/dev/null || true
    wait_bounded 5 "$server_pid"
  fi
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  report_checkpoint
  # (a trap's handler returns to where the script was: a Ctrl-C while it waited for the server
  # went on to "the server did not start" and exit 1)
  case ${1:-EXIT} in INT) exit 130 ;; TERM) exit 143 ;; HUP) exit 129 ;; PIPE) exit 141 ;; esac
}
trap 'cleanup INT' INT
trap 'cleanup TERM' TERM
trap 'cleanup HUP' HUP
trap 'cleanup PIPE' PIPE
trap 'cleanup EXIT' EXIT
# (a reader that went away, `demo.sh | head`: sed fails on its output, and the rest of the
# server's and ranks' output is drained, so their writes do not fail and their stop stays ordered)
prefix() { ( trap '' INT TERM PIPE; sed -u "s/^/[$1] /" 2> /dev/null || true; exec cat > /dev/null ); }
lead=()   # roles: the demo's native ranks carry the trainer token the server keeps in $CKPT
[ "$RANKS" = 0 ] && lead=(--any-rank-may-lead)   # tabs only: any rank may lead (a trusted group)
# the operator token for this run (the view's link below carries it; serve would otherwise make one)
# (given in the server's environment, not its arguments, which any user of the machine reads in ps)
op_token="${TABCOHORT_OPERATOR_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_hex(24))')}"
TABCOHORT_OPERATOR_TOKEN="$op_token" "$PY" -m tabcohort serve --host "$HOST" --port "$PORT" --room digits --dataset digits \
  --steps "$STEPS" --checkpoint-dir "$CKPT" ${lead[@]+"${lead[@]}"} > >(prefix server) 2>&1 &
server_pid=$!
pids+=($!)
url="http://127.0.0.1:$PORT"
up=0 deadline=$(( $(date +%s) + SERVER_WAIT ))
while [ "$(date +%s)" -lt "$deadline" ]; do   # wait (bounded: SERVER_WAIT, 20 s) until the server answers
  if "$PY" -c "import urllib.request; urllib.request.urlopen('$url/healthz', timeout=1)" 2>/dev/null; then up=1; break; fi
  alive "$server_pid" || { echo "[demo] the server did not start (see above)" >&2; exit 1; }
  sleep 0.2
done
if [ "$up" = 0 ]; then   # (the ranks were started anyway, against a server that never answered)
  echo "[demo] the server did not answer $url/healthz within $SERVER_WAIT s; stopping it (its output is above)" >&2
  exit 1
fi
if [ -z "${TABCOHORT_TRAINER_TOKEN:-}" ] && [ -f "$CKPT/.trainer-token" ]; then
  TABCOHORT_TRAINER_TOKEN="$(cat "$CKPT/.trainer-token")"   # (serve wrote it before it answered)
  export TABCOHORT_TRAINER_TOKEN
fi
for i in $(seq 1 "$RANKS"); do
  # (a process substitution, not a pipe, so that $! is the rank itself, not sed)
  "$PY" -m tabcohort rank --server "$url" --room digits --print-every 5 > >(prefix "rank $i") 2>&1 &
  pids+=($!)
  rank_pids+=($!)
done
q=""   # a room token from the environment (serve reads it): the tab's link carries it
if [ -n "${TABCOHORT_TOKEN:-}" ]; then
  q="?room=digits&token=$("$PY" -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$TABCOHORT_TOKEN")"
fi
shown="$url/$q"
[ "$HOST" = 0.0.0.0 ] && shown="http://$(hostname -I 2>/dev/null | awk '{print $1}'):$PORT/$q (this machine: $url/$q)"
echo
echo "  Open $shown in a browser to join the cohort from a tab."
echo "  Operator view: $url/operator?room=digits#operator=$op_token"
echo "  Metrics: $url/metrics   Ctrl-C stops."
echo
if [ "$STEPS" != 0 ] && [ ${#rank_pids[@]} -gt 0 ]; then
  wait "${rank_pids[@]}" || true      # the room stops at STEPS; the ranks exit; then so do we
  if [ -n "$resumed_step" ] && [ "$resumed_step" -ge "$STEPS" ]; then
    # (it said "the room reached its step limit (500)" of a checkpoint already at step 90000)
    echo "[demo] nothing to train: the checkpoint was already at step $resumed_step, at or past the step limit" \
         "(STEPS=$STEPS); raise STEPS, or FRESH=1 to start from scratch"
  else
    echo "[demo] the room reached its step limit ($STEPS)"
  fi
else
  wait "$server_pid" || true
fi
