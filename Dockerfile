# tabcohort: the server (`tabcohort serve`) and headless native ranks (`tabcohort rank`) in one image.
#
#   docker build -t tabcohort:local .
#   docker run --rm -p 8080:8080 tabcohort:local                      # serve (default command)
#   docker run --rm tabcohort:local rank --server http://HOST:8080    # a native rank
#
# Layout in the image (the server finds web/ and node_modules/ relative to the project root, the
# parent of server/; see server/tabcohort_server/static.py):
#   /app                       the project (pyproject.toml, client_py/, server/, web/), installed
#                              editable into /opt/venv so the server's ROOT is /app
#   /app/node_modules/pyodide  the pinned Pyodide core (package-lock.json), served at /pyodide/
#   /app/node_modules/uplot    the page's chart library, served at /vendor/uplot/
#   /data                      writable by the runtime user (e.g. --checkpoint-dir /data)
# The client wheel the tab loads is built by the server from /app/client_py at first request.
#
# Nothing here names a package index or registry: apt, pip and npm use their defaults (or whatever
# the base image's environment configures).

# ---------------------------------------------------------------- stage 1: the Pyodide core (npm)
FROM debian:bookworm-slim AS pyodide
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends nodejs npm ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY package.json package-lock.json ./
# Exactly the lockfile's versions; no install scripts. (Debian's Node is 18; package.json asks for
# >=20 for the Pyodide *test tier*, which does not run here: fetching files needs no engine check.)
RUN npm ci --ignore-scripts --no-audit --no-fund --engine-strict=false \
 && test -f node_modules/pyodide/pyodide.mjs \
 && rm -rf /root/.npm

# ---------------------------------------------------------------- the cluster's Redis (Debian's package)
# Only the compose `cluster` profile builds this target (docker-compose.yml, service redis).
FROM debian:bookworm-slim AS redis
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
USER redis
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]

# ---------------------------------------------------------------- stage 2: the runtime image
FROM debian:bookworm-slim
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --create-home --home-dir /home/tabcohort \
      --shell /usr/sbin/nologin tabcohort \
 && mkdir -p /data && chown tabcohort:tabcohort /data

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv

WORKDIR /app

# Dependencies first (this layer only changes with pyproject.toml): the runtime dependencies, the
# `digits` extra (scikit-learn, for the digits data set) and the build backend, read from
# pyproject.toml itself so the list lives in one place.
COPY pyproject.toml ./
RUN python3 -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); p = d['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['digits'] + d['build-system']['requires']))" \
      > /tmp/requirements.txt \
 && cat /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# The Pyodide core and uPlot, from the npm stage (only these two packages).
COPY --from=pyodide /src/node_modules/pyodide /app/node_modules/pyodide
COPY --from=pyodide /src/node_modules/uplot /app/node_modules/uplot

# Then the sources, installed editable with no network (deps and backend are already here).
COPY README.md ./
COPY client_py ./client_py
COPY server ./server
COPY web ./web
RUN pip install --no-deps --no-build-isolation -e . \
 && tabcohort --help > /dev/null \
 && python -c "import sklearn, numpy, aiohttp, prometheus_client, tabcohort_server.static as s; \
assert str(s.ROOT) == '/app', s.ROOT; assert s._pyodide_dir() is not None, 'no Pyodide core'"

USER tabcohort
EXPOSE 8080
# The server's health; a rank container (same image) should disable it (docker-compose.yml does).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('TABCOHORT_HEALTH_URL', 'http://127.0.0.1:8080/healthz'), timeout=4)"]
ENTRYPOINT ["tabcohort"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
