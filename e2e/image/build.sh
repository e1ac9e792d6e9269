#!/usr/bin/env bash
# Build the RouterFleet container image without any image registry:
#
#   1. tools: Docker's engine (docker.io) and debootstrap from Debian, installed with apt if missing;
#      dockerd started in the background if no daemon answers (log: $cache/dockerd.log);
#   2. base image routerfleet-base:bookworm: debootstrap of Debian bookworm (minbase + python3,
#      python3-venv, ca-certificates), tarred into $cache/base-bookworm-<hash>.tar and
#      `docker import`ed. The tarball is kept, so later machines' runs (and runs after
#      `docker rmi`) skip debootstrap; the image is reused while its label matches <hash>;
#   3. wheelhouse build/wheelhouse/ (in the tree, git-ignored): `pip wheel '.[speed]'` on the host
#      with a Python of the base image's major.minor (containers here cannot reach the package
#      index; the Dockerfile installs these wheels with --no-index);
#   4. `docker build` of the project image.
#
# $cache is ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/image. Progress and timings go to stderr;
# the last stdout line is the image name:   IMAGE=$(e2e/image/build.sh | tail -1)
#
# Settings (environment):
#   ROUTERFLEET_IMAGE        image to build (default routerfleet:dev)
#   ROUTERFLEET_BASE_IMAGE   base image; the default routerfleet-base:bookworm is made here, any
#                            other (e.g. python:3.11-slim where a registry is reachable) is used as is
#   ROUTERFLEET_DEBIAN_MIRROR  mirror for debootstrap (default: the first Debian URI in apt's sources)
#   ROUTERFLEET_WHEEL_PYTHON Python that builds the wheelhouse (default: .venv/bin/python, else python3)
#   DOCKER_BUILDKIT          default 0 (legacy builder: works with Debian's docker 20.10 and with newer
#                            clients that lack the buildx plugin); 1 works where BuildKit is available
#   ROUTERFLEET_DOCKERD_ARGS dockerd flags when this script starts the daemon (default
#                            "--iptables=false --ip-forward=false --bridge=none"; "" for Docker's
#                            default bridge networking). A daemon already running is used as it is.
# Needs root for apt, debootstrap and starting dockerd (not when those are already done).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
die() { echo "e2e/image/build.sh: error: $*" >&2; exit 1; }
say() { echo "[image-build] $*" >&2; }

cache=${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/image
image=${ROUTERFLEET_IMAGE:-routerfleet:dev}
default_base=routerfleet-base:bookworm
base=${ROUTERFLEET_BASE_IMAGE:-$default_base}
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}
mkdir -p "$cache"

exec 9>"$cache/build.lock"
if ! flock -n 9; then say "another image build is running; waiting for it"; flock 9; fi

# The base image's recipe; its hash names the cached tarball and labels the imported image.
suite=bookworm
include=python3,python3-venv,ca-certificates
make_base_rev=1   # bump when the rootfs recipe in step 2 changes
base_hash=$(echo "$suite $include $make_base_rev" | sha256sum | cut -c1-12)
tarball=$cache/base-$suite-$base_hash.tar

t_start=$SECONDS
declare -a timings=()
step_t0=0
step() { step_t0=$SECONDS; say "$*"; }
done_step() { timings+=("$1 $((SECONDS - step_t0))s"); say "  $1: $((SECONDS - step_t0))s"; }

need_root() { [[ $(id -u) -eq 0 ]] || die "$* needs root (run as root, or do it by hand first)"; }

# ---- 1. tools ---------------------------------------------------------------------------------------
step "tools"
missing=()
# docker.io brings dockerd, containerd and runc (and iptables, which the daemon started below skips).
if ! command -v docker >/dev/null 2>&1 ||
  { ! docker info >/dev/null 2>&1 && ! command -v dockerd >/dev/null 2>&1; }; then
  missing+=(docker.io)
fi
# debootstrap only when the base tarball is not cached yet.
if [[ $base == "$default_base" && ! -s $tarball ]] && ! command -v debootstrap >/dev/null 2>&1; then
  missing+=(debootstrap)
fi
if ((${#missing[@]})); then
  need_root "installing ${missing[*]}"
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them"
  say "installing ${missing[*]} from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >"$cache/apt.log" 2>&1 || { tail -20 "$cache/apt.log" >&2; die "apt-get update failed"; }
  apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$cache/apt.log" 2>&1 ||
    { tail -20 "$cache/apt.log" >&2; die "apt-get install ${missing[*]} failed; log: $cache/apt.log"; }
fi

# Daemon networking: the build and the smoke run use host networking only, so the daemon this script
# starts gets no bridge and leaves the host's iptables and ip_forward alone (Docker's default
# networking would install its chains and set the FORWARD policy to DROP on a shared CI host).
dockerd_args=${ROUTERFLEET_DOCKERD_ARGS---iptables=false --ip-forward=false --bridge=none}
start_dockerd() {
  need_root "starting dockerd"
  command -v dockerd >/dev/null 2>&1 || die "no dockerd (apt-get install docker.io)"
  say "starting dockerd $dockerd_args (log: $cache/dockerd.log)"
  # Detached (setsid), so it outlives this script like a service would; 9>&-: it must not inherit
  # (and hold forever) this script's lock.
  # shellcheck disable=SC2086
  setsid nohup dockerd $dockerd_args >>"$cache/dockerd.log" 2>&1 </dev/null 9>&- &
  local pid=$! _
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  kill "$pid" 2>/dev/null || true
  tail -30 "$cache/dockerd.log" >&2
  die "dockerd did not come up in 60s; log: $cache/dockerd.log"
}
if ! docker info >/dev/null 2>&1; then
  if [[ -S /var/run/docker.sock ]] && pgrep -x dockerd >/dev/null 2>&1; then
    die "dockerd runs but does not answer 'docker info' (permissions on /var/run/docker.sock?)"
  fi
  start_dockerd
fi
say "docker: client $(docker version -f '{{.Client.Version}}' 2>/dev/null), daemon $(docker version -f '{{.Server.Version}}' 2>/dev/null), storage $(docker info -f '{{.Driver}}' 2>/dev/null)"
done_step tools

# ---- 2. base image ----------------------------------------------------------------------------------

debian_mirror() {
  [[ -n ${ROUTERFLEET_DEBIAN_MIRROR:-} ]] && { echo "$ROUTERFLEET_DEBIAN_MIRROR"; return; }
  local m
  m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -v '^\s*#' | grep -oE '(https?|file)://[^ ]*/debian/?( |$)' | head -1 | tr -d ' ')
  echo "${m:-http://deb.debian.org/debian}"
}

# An interrupted debootstrap can leave proc/sys mounted in its target: never rm -rf through them.
unmount_under() {
  local _dev mnt _rest
  while read -r _dev mnt _rest; do
    if [[ $mnt == "$1"/* ]]; then umount -l "$mnt" 2>/dev/null || true; fi
  done < <(sort -r -k2 /proc/mounts)
}

step "base image $base"
if [[ $base != "$default_base" ]]; then
  docker image inspect "$base" >/dev/null 2>&1 || say "  $base is not local; docker build will try to pull it"
elif [[ $(docker image inspect -f '{{index .Config.Labels "org.routerfleet.base"}}' "$base" 2>/dev/null) == "$base_hash" ]]; then
  say "  $base is up to date ($base_hash)"
else
  if [[ ! -s $tarball ]]; then
    need_root "debootstrap"
    mirror=$(debian_mirror)
    rootfs=$cache/rootfs.partial
    unmount_under "$rootfs"; rm -rf "$rootfs"; mkdir -p "$rootfs"
    say "  debootstrap --variant=minbase --include=$include $suite from $mirror (about a minute)"
    debootstrap --variant=minbase --include="$include" "$suite" "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
      { tail -20 "$cache/debootstrap.log" >&2; die "debootstrap failed; log: $cache/debootstrap.log"; }
    # Slim it: package caches, lists, docs; the host's resolv.conf/hostname (docker provides its own).
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
      "$rootfs"/var/log/bootstrap.log "$rootfs"/var/log/apt/* "$rootfs"/var/log/dpkg.log
    : >"$rootfs/etc/resolv.conf"; echo localhost >"$rootfs/etc/hostname"
    chroot "$rootfs" python3 -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' ||
      die "the debootstrapped rootfs has no usable python3 >= 3.11"
    tar --numeric-owner -C "$rootfs" -cf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
    unmount_under "$rootfs"; rm -rf "$rootfs"
    say "  cached $tarball ($(du -m "$tarball" | cut -f1) MB)"
  else
    say "  importing the cached $tarball"
  fi
  docker import \
    --change "LABEL org.routerfleet.base=$base_hash" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$tarball" "$base" >/dev/null
fi
done_step base-image

# ---- 3. wheelhouse ------------------------------------------------------------------------------------
step "wheelhouse build/wheelhouse"
py=${ROUTERFLEET_WHEEL_PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x $root/.venv/bin/python ]]; then py=$root/.venv/bin/python; else py=python3; fi
fi
host_ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "cannot run $py"
base_full=$(docker run --rm --network none --entrypoint python3 "$base" \
  -c 'import platform; print(platform.python_version())' 2>/dev/null) || base_full=unknown
base_ver=${base_full%.*}
[[ $base_ver == unknown || $host_ver == "$base_ver" ]] ||
  die "$py is Python $host_ver but $base has $base_ver: binary wheels would not fit; set ROUTERFLEET_WHEEL_PYTHON to a python$base_ver"
wh=$root/build/wheelhouse
rm -rf "$wh.partial"; mkdir -p "$wh.partial"
# The project's wheel is built from a fresh copy of the tree (without venvs, caches and build
# output): setuptools' in-tree build/lib keeps deleted modules, which would end up in the wheel.
src=$cache/src
rm -rf "$src"; mkdir -p "$src"
tar -C "$root" --exclude=./.git --exclude='./.venv*' --exclude=./.cache --exclude=./build \
  --exclude='*.egg-info' --exclude=__pycache__ --exclude=./.pytest_cache --exclude=./.ruff_cache \
  --exclude=./.hypothesis --exclude=./native/target -cf - . | tar -C "$src" -xf -
# The native core's wheel is the one `make setup` built (native/target/wheels), found by name.
native=$root/native/target/wheels
compgen -G "$native/routerfleet_index-*.whl" >/dev/null || die "no native wheel in $native: run make setup first"
# pip's own cache (~/.cache/pip) makes this quick after the first time.
"$py" -m pip wheel -q --disable-pip-version-check --find-links "$native" --wheel-dir "$wh.partial" \
  "${src}[speed]" >"$cache/wheel.log" 2>&1 ||
  { tail -30 "$cache/wheel.log" >&2; die "pip wheel failed; log: $cache/wheel.log"; }
# pip evaluated the requirements' markers for the host's Python; the image's may be an older patch
# release (Debian's 3.11.2: redis then needs async-timeout, for python_full_version < "3.11.3"). Wheel
# what the image's Python needs besides.
if [[ $base_full != unknown ]]; then
  extra=$("$py" - "$wh.partial" "$base_full" <<'PY'
import sys, zipfile, pathlib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
wh, full = pathlib.Path(sys.argv[1]), sys.argv[2]
env = {**default_environment(), "python_full_version": full, "python_version": ".".join(full.split(".")[:2])}
have, need = set(), []
for w in wh.glob("*.whl"):
    have.add(canonicalize_name(w.name.split("-")[0]))
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                r = Requirement(line.split(":", 1)[1].strip())
                if r.marker is not None and r.marker.evaluate({**env, "extra": "speed"}):
                    need.append(r)
print(" ".join(sorted({str(r).split(";")[0].replace(" ", "") for r in need if canonicalize_name(r.name) not in have})))
PY
  ) || die "cannot read the wheelhouse's requirements"
  if [[ -n $extra ]]; then
    # shellcheck disable=SC2086 # one requirement per word
    "$py" -m pip wheel -q --disable-pip-version-check --wheel-dir "$wh.partial" $extra >>"$cache/wheel.log" 2>&1 ||
      { tail -30 "$cache/wheel.log" >&2; die "pip wheel of $extra (for Python $base_full) failed; log: $cache/wheel.log"; }
    say "  for the image's Python $base_full: $extra"
  fi
fi
rm -rf "$wh" "$src"; mv "$wh.partial" "$wh"
say "  $(find "$wh" -name '*.whl' | wc -l) wheels with Python $host_ver, $(du -sm "$wh" | cut -f1) MB"
done_step wheelhouse

# ---- 4. image -----------------------------------------------------------------------------------------
step "docker build -t $image (base $base, DOCKER_BUILDKIT=$DOCKER_BUILDKIT)"
# Host networking: the build needs no network with a wheelhouse, and this avoids depending on the
# bridge (absent when dockerd runs with --bridge=none).
old_id=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
docker build --network host --build-arg "BASE_IMAGE=$base" -t "$image" -f "$root/Dockerfile" "$root" \
  >"$cache/docker-build.log" 2>&1 ||
  { tail -30 "$cache/docker-build.log" >&2; die "docker build failed; log: $cache/docker-build.log"; }
# Leftovers: the build stage (untagged, labelled) and the image this build replaced under $image.
docker image prune -f --filter label=org.routerfleet.stage=build >/dev/null 2>&1 || true
new_id=$(docker image inspect -f '{{.Id}}' "$image")
if [[ -n $old_id && $old_id != "$new_id" ]]; then docker rmi "$old_id" >/dev/null 2>&1 || true; fi
say "  $image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%d MB", $1/1e6}')"
done_step docker-build

say "done in $((SECONDS - t_start))s: ${timings[*]}"
echo "$image"
