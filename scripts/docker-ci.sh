#!/usr/bin/env bash
# A Docker engine for the compose test (tests/test_compose_e2e.py), on a machine that may have none.
#
#   eval "$(scripts/docker-ci.sh start)"   # engine up, images ready; prints the `export` lines of the images to use
#   scripts/docker-ci.sh stop              # stops the dockerd that `start` started (by its pid), nothing else,
#                                          # after removing the untagged images of earlier tradeloop builds
#
# start:
#   1. An engine that answers is used as it is (and `stop` leaves it alone). Otherwise, as root on Debian:
#      Debian's docker.io (dockerd, containerd, runc) is installed where dockerd is missing, and dockerd is
#      started in the background, its pid in $TL_DOCKER_STATE/dockerd.pid and its log beside it.
#   2. Where `docker compose` is missing: the static Compose v2 plugin of Debian trixie's docker-compose package,
#      fetched with an apt state of its own (the host's sources stay as they are), copied to
#      /usr/local/lib/docker/cli-plugins/.
#   3. Images: the Dockerfile's default base (ARG BASE_IMAGE) and the compose file's default Redis image
#      (REDIS_IMAGE) are used where present or pullable. Where no registry answers, the base is built from the
#      host's own apt sources (mmdebstrap --variant=minbase: python3 + venv, the host's extra CA certificates so
#      pip reaches the package index through the host's proxy) and `docker import`ed, and the Redis image is
#      built from it with Debian's redis-server (docker/redis/Dockerfile). Both are tagged by a hash of their
#      recipe: a second run finds them and builds nothing.
#   4. The CPU torch wheel the host's pip resolves for the Makefile's TORCH_PIN is downloaded into
#      docker/wheels/ (the image installs it instead of reaching a torch index); a CUDA build is not kept.
# Everything but the export lines goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${TL_DOCKER_STATE:-/tmp/tradeloop-docker}
PIDFILE=$STATE/dockerd.pid
SUITE=${TL_DEBIAN_SUITE:-bookworm}
SOURCES=${TL_DEBIAN_SOURCES:-/etc/apt/sources.list.d/debian.sources}
COMPOSE_SUITE=${TL_COMPOSE_SUITE:-trixie}
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
BASE_PACKAGES=python3,python3-venv,ca-certificates

log() { echo "docker-ci: $*" >&2; }
die() { log "error: $*"; exit 1; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

engine_answers() { timeout 20 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "no apt-get: install a Docker engine and the compose plugin by hand"
  [ -n "${APT_UPDATED:-}" ] || { $SUDO apt-get update -qq >&2 || true; APT_UPDATED=1; }
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >&2
}

start_engine() {
  mkdir -p "$STATE"
  if engine_answers; then
    log "a Docker engine answers ($(docker version --format '{{.Server.Version}}')); using it"
    return
  fi
  command -v dockerd >/dev/null 2>&1 || { log "installing Debian's docker.io"; apt_install docker.io iptables; }
  log "starting dockerd (log: $STATE/dockerd.log)"
  # setsid: the daemon leaves the caller's process group, so a Ctrl-C of the test run does not kill it mid-build
  $SUDO setsid dockerd >"$STATE/dockerd.log" 2>&1 < /dev/null &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 120); do
    engine_answers && { log "dockerd $(docker version --format '{{.Server.Version}}') up (pid $(cat "$PIDFILE"))"; return; }
    kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { tail -20 "$STATE/dockerd.log" >&2; die "dockerd exited"; }
    sleep 0.5
  done
  tail -20 "$STATE/dockerd.log" >&2
  die "dockerd did not answer in 60 s"
}

install_compose_plugin() {
  docker compose version >/dev/null 2>&1 && return
  log "installing the Compose v2 plugin from Debian $COMPOSE_SUITE's docker-compose package"
  local tmp uri
  tmp=$(mktemp -d)
  uri=$(sed -n 's/^URIs: *//p' "$SOURCES" | head -1)
  mkdir -p "$tmp/sources" "$tmp/lists/partial" "$tmp/cache/archives/partial"
  printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "${uri:-http://deb.debian.org/debian}" "$COMPOSE_SUITE" >"$tmp/sources/compose.sources"
  local opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$tmp/sources" -o "Dir::State::Lists=$tmp/lists"
              -o "Dir::Cache=$tmp/cache" -o "Dir::State::status=/dev/null" -o "APT::Sandbox::User=root")
  apt-get "${opts[@]}" update -qq >&2
  (cd "$tmp" && apt-get "${opts[@]}" download docker-compose >&2)
  dpkg-deb -x "$tmp"/docker-compose_*.deb "$tmp/root"
  $SUDO mkdir -p "$PLUGIN_DIR"
  $SUDO install -m 0755 "$tmp/root/usr/libexec/docker/cli-plugins/docker-compose" "$PLUGIN_DIR/docker-compose"
  rm -rf "$tmp"
  docker compose version >&2 || die "the compose plugin does not run"
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# An image that is here or pullable: 0; no registry answered: 1.
pullable() {
  have_image "$1" && return 0
  log "pulling $1"
  timeout "${TL_PULL_TIMEOUT_S:-30}" docker pull -q "$1" >/dev/null 2>&1
}

recipe_hash() { cat "$@" | sha256sum | cut -c1-12; }

# The base image's recipe; its hash (with the sources and the certificates) tags the image.
HOOK_CERTS='for c in /usr/local/share/ca-certificates/*.crt; do [ -e "$c" ] && cp "$c" "$1/usr/local/share/ca-certificates/"; done; chroot "$1" update-ca-certificates >/dev/null'
HOOK_CLEAN='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/* "$1"/usr/share/locale/*'

local_base() {
  local tag
  tag="tradeloop-base:$SUITE-$({ echo "$SUITE $BASE_PACKAGES $HOOK_CERTS $HOOK_CLEAN"; cat "$SOURCES";
                                cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true; } | sha256sum | cut -c1-12)"
  if have_image "$tag"; then log "base image $tag is here"; echo "$tag"; return; fi
  command -v mmdebstrap >/dev/null 2>&1 || apt_install mmdebstrap
  log "building $tag with mmdebstrap ($SUITE minbase + $BASE_PACKAGES, the host's CA certificates)"
  local t0=$SECONDS
  $SUDO mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" --dpkgopt=force-unsafe-io \
    --aptopt='Acquire::Languages "none"' \
    --customize-hook="$HOOK_CERTS" --customize-hook="$HOOK_CLEAN" "$SUITE" - "$SOURCES" \
    | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >&2
  log "built $tag in $((SECONDS - t0)) s"
  echo "$tag"
}

local_redis() {
  local base=$1 tag
  tag="tradeloop-redis:$SUITE-$(echo "$base" | cat - docker/redis/Dockerfile | sha256sum | cut -c1-12)"
  if have_image "$tag"; then log "redis image $tag is here"; echo "$tag"; return; fi
  log "building $tag (Debian's redis-server on $base)"
  docker build -q --build-arg "BASE_IMAGE=$base" -t "$tag" docker/redis >&2
  echo "$tag"
}

torch_wheel() {
  local pin have py
  pin=$(sed -n 's/^TORCH_PIN *:*= *//p' Makefile)
  [ -n "$pin" ] || { log "no TORCH_PIN in the Makefile: the image installs torch from its index"; return; }
  mkdir -p docker/wheels
  have=$(ls docker/wheels/torch-"${pin#torch==}"+cpu-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$have" ]; then
    py=$(command -v python3 || true)
    if [ -z "$py" ] || ! "$py" -m pip --version >/dev/null 2>&1; then log "no pip on the host: no torch wheel"; return; fi
    log "downloading $pin (the host's pip) into docker/wheels/"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
      -d docker/wheels "$pin" >&2 || { log "pip download $pin failed: the image installs torch from its index"; return; }
    have=$(ls docker/wheels/torch-"${pin#torch==}"+cpu-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$have" ]; then
      log "the host's pip resolved $pin to a non-CPU build; not used"
      rm -f docker/wheels/torch-*.whl
      return
    fi
  fi
  log "torch wheel: $have"
  echo "$have"
}

case "${1:-}" in
  start)
    t0=$SECONDS
    start_engine
    install_compose_plugin
    base_default=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
    redis_default=$(sed -n 's/.*\${REDIS_IMAGE:-\([^}]*\)}.*/\1/p' docker-compose.yml | head -1)
    if pullable "$base_default"; then base=$base_default; else log "no registry answered"; base=$(local_base); fi
    if pullable "$redis_default"; then redis=$redis_default; else redis=$(local_redis "$base"); fi
    wheel=$(torch_wheel)
    log "ready in $((SECONDS - t0)) s"
    echo "export BASE_IMAGE=$base"
    echo "export REDIS_IMAGE=$redis"
    echo "export TORCH_WHEEL=$wheel"
    ;;
  stop)
    [ -f "$PIDFILE" ] || { log "no dockerd started here; nothing to stop"; exit 0; }
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
      # the images earlier builds of this project left untagged (each run's code layers); layers still in use stay
      docker image prune -f --filter label=org.opencontainers.image.title=tradeloop >/dev/null 2>&1 || true
      log "stopping dockerd (pid $pid)"
      $SUDO kill -TERM "$pid"
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && { log "dockerd still up after 30 s: SIGKILL"; $SUDO kill -KILL "$pid"; }
    fi
    rm -f "$PIDFILE"
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
