#!/usr/bin/env bash
# The Slurm version matrix: newer Slurm (Debian trixie = 24.11, sid = 26.05) in debootstrap chroots,
# built once and cached outside the checkout, and the real-cluster tier run inside them.
#
#   .ci/slurm-matrix.sh build SUITE          # debootstrap + slurm-wlm/munge/tini (cached, ~1 min)
#   .ci/slurm-matrix.sh run SUITE CMD...     # CMD inside SUITE's chroot, in this checkout
#   .ci/slurm-matrix.sh version SUITE        # the chroot's Slurm version
#   .ci/slurm-matrix.sh matrix "host trixie sid" PYTEST_ARGS...
#                                            # pytest on each (host = this machine's own Slurm),
#                                            # one summary line per version, non-zero if any failed
#
# Inside, this checkout, its .venv and the venv's base interpreter are bind-mounted at their own
# paths (so the host's Python 3.11 and torch wheel run against the chroot's Slurm); the chroot
# gets only the shared libraries that interpreter and its wheels link against. Every mount lives
# in a private mount namespace (unshare --mount) and goes with the command: nothing to clean up.
# Cache: $CKPTSUP_SLURM_CHROOTS (default /var/cache/ckptsup/slurm-chroots).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${CKPTSUP_SLURM_CHROOTS:-/var/cache/ckptsup/slurm-chroots}"
VENV="${VENV:-$ROOT/.venv}"
# what the chroot needs beyond minbase: Slurm and the libraries the host's Python links against
PACKAGES="slurmctld slurmd slurm-client munge tini procps util-linux mount ca-certificates
          libexpat1 libffi8 zlib1g libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libuuid1
          libstdc++6 libgomp1 libgcc-s1 runc"
# names that changed with the 64-bit time_t transition (trixie and later)
PACKAGES_T64="libssl3t64 libreadline8t64 libgdbm6t64"

die() { echo "slurm-matrix: $*" >&2; exit 2; }

usage() { die "usage: $0 build SUITE | run SUITE CMD... | version SUITE (SUITE: trixie, sid)"; }

mirror() {
  # the machine's own Debian mirror (deb822 .sources or one-line sources.list)
  local uri
  uri=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)
  [ -n "$uri" ] || uri=$(grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                          | awk '{print $2}' | grep -v security | head -1 || true)
  [ -n "$uri" ] || die "no Debian mirror in /etc/apt/sources.list{,.d}; add one (e.g. the one apt uses)"
  echo "$uri"
}

build() {
  local suite=$1 dir="$CACHE/$1"
  # a chroot cached before runc joined PACKAGES (the dev cluster's OCI containers) is built again
  if [ -f "$dir/.ckptsup-ready" ] && [ -x "$dir/usr/sbin/runc" ]; then return 0; fi
  rm -rf "$dir"
  [ "$(id -u)" = 0 ] || die "building a chroot needs root"
  command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
  mkdir -p "$CACHE"
  local tmp="$dir.partial"
  rm -rf "$tmp"
  echo "slurm-matrix: debootstrap $suite into $dir (once; cached)" >&2
  debootstrap --variant=minbase "$suite" "$tmp" "$(mirror)" >"$CACHE/$suite.debootstrap.log" 2>&1 \
    || die "debootstrap $suite failed; see $CACHE/$suite.debootstrap.log"
  # sid's Release file may be past Valid-Until in a mirror snapshot
  echo 'Acquire::Check-Valid-Until "false";' >"$tmp/etc/apt/apt.conf.d/99ckptsup"
  cp /etc/resolv.conf "$tmp/etc/resolv.conf" 2>/dev/null || true
  # minbase writes no /etc/hosts: the dev cluster bind-mounts its own over it, so one must exist
  [ -f "$tmp/etc/hosts" ] || printf '127.0.0.1 localhost\n::1 localhost\n' >"$tmp/etc/hosts"
  chroot "$tmp" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends $(echo $PACKAGES $PACKAGES_T64)" \
    >"$CACHE/$suite.apt.log" 2>&1 || die "apt-get install in the $suite chroot failed; see $CACHE/$suite.apt.log"
  chroot "$tmp" dpkg-query -W -f 'slurm ${Version}\n' slurmd >"$tmp/.ckptsup-ready"
  mv "$tmp" "$dir"
  echo "slurm-matrix: $suite ready: $(cat "$dir/.ckptsup-ready")" >&2
}

run() {
  local suite=$1; shift
  local dir="$CACHE/$suite"
  build "$suite"
  [ -x "$VENV/bin/python" ] || die "no venv at $VENV; run \`make venv\` first"
  local base
  base=$("$VENV/bin/python" -c 'import sys; print(sys.base_prefix)')
  # what to bind at its own path: the checkout (venv inside or not), the venv, the interpreter
  # and this machine's /etc/hosts: Slurm's clients resolve their own host name, as on the host
  local binds=("$ROOT" "$(readlink -f "$VENV")" /etc/hosts)
  if [ "$base" = /usr ]; then
    local ver; ver=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    binds+=("/usr/lib/python$ver" "/usr/bin/python$ver")
  else
    binds+=("$base")
  fi
  # /tmp is this machine's: the test fixture's flock (/tmp/ckptsup-test-cluster*.lock) then keeps a
  # chroot's cluster off the ports of one running on the host, as it does between host sessions
  local script='set -e
    mount --bind "$D" "$D"           # a mount point: unshare --mount-proc inside needs one
    mount --make-private "$D"
    mount -t proc proc "$D/proc"
    mount -t sysfs sys "$D/sys"
    mount --rbind /sys/fs/cgroup "$D/sys/fs/cgroup"   # runc (the dev cluster'"'"'s OCI containers) makes cgroups there
    mount --rbind /dev "$D/dev"
    mount --bind /tmp "$D/tmp"
    for b in '"$(printf '%q ' "${binds[@]}")"'; do
      if [ -d "$b" ]; then mkdir -p "$D$b"; else mkdir -p "$D$(dirname "$b")"; touch "$D$b"; fi
      mount --bind "$b" "$D$b"
    done
    cd "$PWD_HOST"
    exec chroot "$D" /usr/bin/env -u LD_LIBRARY_PATH PATH="$VENV_BIN:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
      sh -c "cd \"$PWD_HOST\" && exec \"\$@\"" sh "$@"'
  D="$dir" PWD_HOST="$PWD" VENV_BIN="$VENV/bin" \
    unshare --mount --propagation private bash -c "$script" bash "$@"
}

run_on() {  # SUITE CMD...: `host` runs CMD here, against this machine's own Slurm
  local suite=$1; shift
  if [ "$suite" = host ]; then "$@"; else run "$suite" "$@"; fi
}

matrix() {
  local suites=$1; shift
  local logs="$CACHE/logs" rows=() failed=0 tag="${MATRIX_TAG:-slurm}"
  mkdir -p "$logs"
  for suite in $suites; do
    [ "$suite" = host ] || build "$suite"
    local version t0=$SECONDS rc=0
    version=$(run_on "$suite" slurmd -V 2>&1 | head -1)
    echo "slurm-matrix: $suite ($version): pytest $*" >&2
    run_on "$suite" "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$logs/$suite.$tag.log" || rc=$?
    [ "$rc" = 0 ] || failed=1
    local summary
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$logs/$suite.$tag.log" | tail -1 | tr -d '=' | xargs)
    rows+=("$suite | $tag | $version | ${summary:-no summary (rc $rc)} | $(( (SECONDS - t0) / 60 )) min $(( (SECONDS - t0) % 60 )) s")
  done
  echo "slurm-matrix: suite | tests | Slurm | pytest | wall (logs in $logs)"
  printf 'slurm-matrix: %s\n' "${rows[@]}"
  return $failed
}

[ $# -ge 2 ] || usage
case "$1" in
  matrix) suites=$2; shift 2; matrix "$suites" "$@" ;;
  build) build "$2" ;;
  run) suite=$2; shift 2; [ $# -ge 1 ] || usage; run "$suite" "$@" ;;
  version) build "$2"; cat "$CACHE/$2/.ckptsup-ready" ;;
  *) usage ;;
esac
