#!/usr/bin/env bash
# Build the tabcohort image and run the docker-compose demo for real, then tear it all down.
#
#   sudo bash tests/container/run.sh            # from anywhere; exit 0 = the demo trained
#
# Phases (each one's time is printed):
#   engine    install Debian's docker.io, docker-compose, debootstrap if missing (apt-get update
#             first); start dockerd in the background if no daemon answers (bounded wait)
#   base      no registry is reachable: if debian:bookworm-slim is not present, debootstrap a
#             minbase bookworm from the mirror the host's apt uses (cached under
#             .cache/container/), add the host's CA certificates, and `docker import` it under
#             that name. Environment-specific settings live only here (the stand-in's ENV).
#   build     docker build with the project's Dockerfile, unchanged
#   up        compose up (server + 2 native ranks) on a free host port
#   train     bounded wait: /healthz answers, the room shows both ranks in a cohort of 2 completing
#             rounds with falling loss; the page, Pyodide core and client wheel are served;
#             the server runs as non-root and its HEALTHCHECK reports healthy
#   cluster-build / cluster-up / cluster-train / cluster-failover
#             the compose `cluster` profile: Redis (the Dockerfile's redis target), two server
#             nodes and two ranks entering through node2; both nodes list the room with one owner,
#             the ranks train on it; the owner is killed and the other node claims the room,
#             resumes it from the shared checkpoint volume and trains on (bounded waits)
#   down      compose down -v (always, via trap); dockerd is stopped only if this script started it
#
# Settings: TABCOHORT_IMAGE (default tabcohort:local), TABCOHORT_TRAIN_TIMEOUT (s, default 180),
# TABCOHORT_ENGINE_TIMEOUT (s, default 60), TABCOHORT_KEEP_BASE=0 to also remove the stand-in base
# image at the end (default: keep it, like any pulled image).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=$ROOT/.cache/container
IMAGE=${TABCOHORT_IMAGE:-tabcohort:local}
BASE=debian:bookworm-slim
TRAIN_TIMEOUT=${TABCOHORT_TRAIN_TIMEOUT:-180}
ENGINE_TIMEOUT=${TABCOHORT_ENGINE_TIMEOUT:-60}
PROJECT=tabcohort-ci-$$
mkdir -p "$CACHE"

T0=$(date +%s)
TIMINGS=()
phase_start() { PHASE=$1; PHASE_T=$(date +%s); echo "=== [$PHASE] $2"; }
phase_end() {
  local dt=$(( $(date +%s) - PHASE_T ))
  TIMINGS+=("$(printf '%-7s %5d s  %s' "$PHASE" "$dt" "${1:-}")")
  echo "=== [$PHASE] done in ${dt} s ${1:-}"
}
die() { echo "container: FAIL: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root (run as root or with sudo)"; }

STARTED_DOCKERD=""
COMPOSE_UP=""
cleanup() {
  local rc=$?
  set +e
  if [ -n "$COMPOSE_UP" ]; then
    if [ "$rc" != 0 ]; then
      echo "--- compose ps / logs (failure) ---"
      "${COMPOSE[@]}" ps
      "${COMPOSE[@]}" logs --no-color --tail=40
    fi
    phase_start down "compose down -v"
    "${COMPOSE[@]}" down -v --remove-orphans --timeout 10
    phase_end
  fi
  if [ "${TABCOHORT_KEEP_BASE:-1}" = 0 ] && [ -n "${IMPORTED_BASE:-}" ]; then
    docker image rm "$BASE" >/dev/null
  fi
  if [ -n "$STARTED_DOCKERD" ]; then
    echo "=== stopping the dockerd this script started (pid $STARTED_DOCKERD)"
    kill "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
  fi
  echo
  echo "=== timings"
  printf '%s\n' "${TIMINGS[@]}"
  echo "total   $(( $(date +%s) - T0 )) s"
  [ "$rc" = 0 ] && echo "container: OK" || echo "container: FAILED (exit $rc)"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------------------ engine
phase_start engine "docker engine, compose, debootstrap"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  need_root "installing ${missing[*]}"
  echo "installing: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  need_root "starting dockerd"
  echo "no daemon answers: starting dockerd (log: $CACHE/dockerd.log)"
  dockerd >"$CACHE/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq "$ENGINE_TIMEOUT"); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$STARTED_DOCKERD" 2>/dev/null || { tail -20 "$CACHE/dockerd.log"; die "dockerd exited"; }
    sleep 1
  done
  docker info >/dev/null 2>&1 || { tail -20 "$CACHE/dockerd.log"; die "dockerd not ready after ${ENGINE_TIMEOUT} s"; }
fi
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
COMPOSE_VERSION=$("${COMPOSE[@]}" version --short 2>/dev/null || true)
COMPOSE+=(-p "$PROJECT" -f "$ROOT/docker-compose.yml")
phase_end "(engine $(docker version --format '{{.Server.Version}}'), ${COMPOSE[0]} $COMPOSE_VERSION)"

# -------------------------------------------------------------------------------------------- base
phase_start base "$BASE"
if docker image inspect "$BASE" >/dev/null 2>&1; then
  phase_end "(present, skipped)"
else
  need_root "debootstrap"
  # The mirror the host's apt already uses for bookworm (one-line or deb822 sources).
  MIRROR=$(python3 - <<'EOF'
import glob, re
files = ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")) \
      + sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))
for f in files:
    try:
        text = open(f).read()
    except OSError:
        continue
    if f.endswith(".sources"):
        for stanza in re.split(r"\n\s*\n", text):
            kv = {}
            for line in stanza.splitlines():
                if line.strip().startswith("#") or ":" not in line:
                    continue
                k, v = line.split(":", 1)
                kv[k.strip().lower()] = v.split()
            if "deb" in kv.get("types", []) and "bookworm" in kv.get("suites", []) and kv.get("enabled", ["yes"]) != ["no"]:
                print(kv["uris"][0]); raise SystemExit
    else:
        for line in text.splitlines():
            w = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
            if len(w) >= 3 and w[0] == "deb" and w[2] == "bookworm":
                print(w[1]); raise SystemExit
EOF
)
  [ -n "$MIRROR" ] || die "no bookworm mirror found in /etc/apt/sources.list{,.d/*}"
  ROOTFS=$CACHE/bookworm-rootfs
  if [ ! -x "$ROOTFS/usr/bin/apt-get" ]; then
    echo "debootstrap minbase bookworm from $MIRROR (cached in $ROOTFS)"
    rm -rf "$ROOTFS.tmp"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$ROOTFS.tmp" "$MIRROR" \
      >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log"; die "debootstrap failed"; }
    mv "$ROOTFS.tmp" "$ROOTFS"
  else
    echo "debootstrap dir cached: $ROOTFS"
  fi
  # Like the official image: an apt that cleans up after itself, no caches.
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  # The host's extra trusted CAs (e.g. a TLS-inspecting egress), so pip and npm reach their
  # registries from inside builds exactly as the host does.
  mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
  if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
    cp -a /usr/local/share/ca-certificates/. "$ROOTFS/usr/local/share/ca-certificates/"
  fi
  chroot "$ROOTFS" update-ca-certificates >/dev/null
  tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["bash"]' \
    - "$BASE" >/dev/null
  IMPORTED_BASE=1
  phase_end "(debootstrap stand-in imported, $(docker image inspect -f '{{.Size}}' "$BASE" | awk '{printf "%.0f MB", $1/1e6}'))"
fi

# ------------------------------------------------------------------------------------------- build
phase_start build "docker build -t $IMAGE (the project's Dockerfile)"
# Proxy settings of the host, if any, as Docker's predefined build args (not kept in the image).
BUILD_ARGS=()
for v in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
  [ -n "${!v:-}" ] && BUILD_ARGS+=(--build-arg "$v")
done
docker build ${BUILD_ARGS[@]+"${BUILD_ARGS[@]}"} -t "$IMAGE" "$ROOT" >"$CACHE/build.log" 2>&1 \
  || { tail -40 "$CACHE/build.log"; die "docker build failed (log: $CACHE/build.log)"; }
SIZE=$(docker image inspect -f '{{.Size}}' "$IMAGE")
phase_end "(image $IMAGE: $SIZE bytes = $(awk -v s="$SIZE" 'BEGIN{printf "%.0f MB", s/1e6}'))"

# ---------------------------------------------------------------------------------------------- up
phase_start up "compose up: server + 2 native ranks"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Every setting docker-compose.yml reads, explicitly (nothing inherited from the caller's shell).
export TABCOHORT_PORT=$PORT TABCOHORT_IMAGE=$IMAGE TABCOHORT_RANKS=2 TABCOHORT_ROOM=digits \
  TABCOHORT_DATASET=digits TABCOHORT_STEPS=0 TABCOHORT_TOKEN= TABCOHORT_BATCH=
COMPOSE_UP=1
# --no-build: the image was just built above; compose starts the ranks once the server is healthy.
"${COMPOSE[@]}" up -d --no-build
phase_end "(server published on 127.0.0.1:$PORT)"

# ------------------------------------------------------------------------------------------- train
phase_start train "until both ranks complete rounds with falling loss (bound ${TRAIN_TIMEOUT} s)"
SERVER_CID=$("${COMPOSE[@]}" ps -q server)
python3 - "$PORT" "$TRAIN_TIMEOUT" <<'EOF'
import json, sys, time, urllib.request
port, bound = int(sys.argv[1]), float(sys.argv[2])
base = f"http://127.0.0.1:{port}"
t0 = time.monotonic()

def get(path, timeout=3):
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return r.status, r.read()

while True:
    try:
        if get("/healthz")[0] == 200:
            break
    except OSError:
        pass
    if time.monotonic() - t0 > bound:
        sys.exit(f"/healthz did not answer within {bound:.0f} s")
    time.sleep(1)
print(f"[{time.monotonic() - t0:6.1f}s] /healthz answers: {get('/healthz')[1].decode()}", flush=True)

ref = None  # the highest loss seen at the start: a rank's first_loss or the first room loss
while True:
    room = json.loads(get("/api/rooms/digits")[1])
    reps = [r["report"] or {} for r in room["ranks"] if r["connected"]]
    for r in reps:
        if r.get("first_loss") is not None:
            ref = max(ref or 0.0, r["first_loss"])
    if ref is None and room["loss"] is not None:
        ref = room["loss"]
    steps = [r.get("step") or 0 for r in reps]
    print(f"[{time.monotonic() - t0:6.1f}s] connected {room['n_connected']}  step {room['step']}  "
          f"ranks' steps {steps}  cohorts {[r.get('cohort') for r in reps]}  "
          f"loss {room['loss']}  (start {ref})  acc {room['accuracy']}", flush=True)
    ok = (room["n_connected"] >= 2 and len(reps) >= 2
          and all(r.get("running") and r.get("cohort") == 2 and (r.get("step") or 0) >= 50 for r in reps)
          and ref is not None and room["loss"] is not None and room["loss"] < 0.5 * ref)
    if ok:
        break
    if time.monotonic() - t0 > bound:
        sys.exit(f"no training with falling loss on 2 ranks within {bound:.0f} s")
    time.sleep(2)
metrics = get("/metrics")[1].decode()
print("\n".join(l for l in metrics.splitlines() if l.startswith(("tabcohort_ranks", "tabcohort_step", "tabcohort_loss"))))
# What a browser tab needs from this server: the page, the local Pyodide core, the client wheel.
boot = json.loads(get("/api/boot")[1])
assert boot["pyodide"]["source"] == "local", boot
assert get("/")[0] == 200
assert get(boot["pyodide"]["url"] + "pyodide.mjs")[0] == 200
status, wheel = get(boot["wheel"]["url"])
assert status == 200 and wheel[:2] == b"PK", "client wheel"
print(f"browser assets: page, Pyodide {boot['pyodide']['version']} (local), {boot['wheel']['name']} "
      f"({len(wheel)} bytes)")
EOF
UID_IN=$(docker exec "$SERVER_CID" id -u)
[ "$UID_IN" != 0 ] || die "the server runs as root"
for _ in $(seq 30); do
  HEALTH=$(docker inspect -f '{{.State.Health.Status}}' "$SERVER_CID")
  [ "$HEALTH" = healthy ] && break
  sleep 2
done
[ "$HEALTH" = healthy ] || die "server HEALTHCHECK status: $HEALTH"
phase_end "(server uid $UID_IN, HEALTHCHECK $HEALTH)"
echo "image size: $IMAGE $SIZE bytes ($(awk -v s="$SIZE" 'BEGIN{printf "%.0f MB", s/1e6}'))"

# --------------------------------------------------------------------------------------- cluster
# The compose `cluster` profile (docker-compose.yml): Redis from the Dockerfile's `redis` target,
# two server nodes sharing one checkpoint volume, two native ranks entering through node2.
phase_start cluster-build "docker build --target redis -t $IMAGE-redis"
docker build ${BUILD_ARGS[@]+"${BUILD_ARGS[@]}"} --target redis -t "$IMAGE-redis" "$ROOT" >"$CACHE/build-redis.log" 2>&1 \
  || { tail -40 "$CACHE/build-redis.log"; die "docker build --target redis failed (log: $CACHE/build-redis.log)"; }
phase_end "(image $IMAGE-redis)"

phase_start cluster-up "compose --profile cluster up: redis, node1, node2, 2 ranks through node2"
NODE1_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
NODE2_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export TABCOHORT_NODE1_PORT=$NODE1_PORT TABCOHORT_NODE2_PORT=$NODE2_PORT TABCOHORT_OPERATOR_TOKEN=
export COMPOSE_PROFILES=cluster     # (so the trap's `down` removes these services too)
"${COMPOSE[@]}" up -d --no-build redis node1 node2 cluster-rank
phase_end "(node1 on 127.0.0.1:$NODE1_PORT, node2 on 127.0.0.1:$NODE2_PORT)"

phase_start cluster-train "the room listed on both nodes with one owner; 2 ranks train on the owner (bound ${TRAIN_TIMEOUT} s)"
OWNER=$(python3 - "$NODE1_PORT" "$NODE2_PORT" "$TRAIN_TIMEOUT" <<'EOF'
import json, sys, time, urllib.request
ports = {"node1": int(sys.argv[1]), "node2": int(sys.argv[2])}
bound = float(sys.argv[3])
t0 = time.monotonic()

def get(node, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[node]}{path}", timeout=3) as r:
        return json.loads(r.read())

while True:
    try:
        views = {n: {r["room"]: r for r in get(n, "/api/rooms")["rooms"]} for n in ports}
        owners = {n: v.get("digits", {}).get("owner") for n, v in views.items()}
        owner = owners["node1"]
        if owner in ports and owners["node2"] == owner:
            room = get(owner, "/api/rooms/digits")
            reps = [r["report"] or {} for r in room["ranks"] if r["connected"]]
            print(f"[{time.monotonic() - t0:6.1f}s] owner {owner}  connected {room['n_connected']}  "
                  f"step {room['step']}  loss {room['loss']}  checkpoint step "
                  f"{(room.get('checkpoint') or {}).get('step')}", file=sys.stderr, flush=True)
            # (and a checkpoint stored in the shared volume: what the next owner resumes from)
            if room["n_connected"] >= 2 and len(reps) >= 2 and room["step"] >= 50 and \
                    all(r.get("cohort") == 2 for r in reps) and room.get("checkpoint"):
                break
        else:
            print(f"[{time.monotonic() - t0:6.1f}s] owners as the nodes list them: {owners}", file=sys.stderr, flush=True)
    except (OSError, ValueError) as e:
        print(f"[{time.monotonic() - t0:6.1f}s] not yet: {e}", file=sys.stderr, flush=True)
    if time.monotonic() - t0 > bound:
        sys.exit(f"the cluster's room did not train on 2 ranks within {bound:.0f} s")
    time.sleep(2)
print(owner)
EOF
)
phase_end "(owner $OWNER)"

phase_start cluster-failover "kill $OWNER: the other node takes the room and training resumes past the checkpoint (bound ${TRAIN_TIMEOUT} s)"
"${COMPOSE[@]}" kill "$OWNER"
python3 - "$NODE1_PORT" "$NODE2_PORT" "$TRAIN_TIMEOUT" "$OWNER" <<'EOF'
import json, sys, time, urllib.request
ports = {"node1": int(sys.argv[1]), "node2": int(sys.argv[2])}
bound, dead = float(sys.argv[3]), sys.argv[4]
alive = next(n for n in ports if n != dead)
t0 = time.monotonic()

def get(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[alive]}{path}", timeout=3) as r:
        return json.loads(r.read())

start = None
while True:
    try:
        owner = {r["room"]: r for r in get("/api/rooms")["rooms"]}.get("digits", {}).get("owner")
        if owner == alive:
            room = get("/api/rooms/digits")
            resumed = room.get("resumed_from") or {}   # the checkpoint it loaded from the shared volume
            if start is None and room["step"]:
                start = room["step"]
            print(f"[{time.monotonic() - t0:6.1f}s] {alive} owns the room: connected {room['n_connected']}  "
                  f"step {room['step']}  resumed from checkpoint step {resumed.get('step')}", flush=True)
            if (room["n_connected"] >= 2 and resumed.get("step") is not None and start is not None
                    and room["step"] >= max(start, resumed["step"]) + 30):
                break
        else:
            print(f"[{time.monotonic() - t0:6.1f}s] owner as {alive} lists it: {owner}", flush=True)
    except (OSError, ValueError) as e:
        print(f"[{time.monotonic() - t0:6.1f}s] not yet: {e}", flush=True)
    if time.monotonic() - t0 > bound:
        sys.exit(f"{alive} did not take the room over and train on 2 ranks within {bound:.0f} s")
    time.sleep(2)
print(f"failover: {alive} owns the room and trains, {time.monotonic() - t0:.1f} s after {dead} was killed")
EOF
phase_end
