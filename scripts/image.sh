#!/usr/bin/env bash
# Build usproxy's container image from Debian packages and PyPI only, with no image registry:
#   1. the base `debian:bookworm-slim` the Dockerfile starts FROM is made here, by debootstrap
#      (--variant=minbase, from the Debian mirror apt uses on this machine), slimmed as Debian's
#      own slim image is (no docs, man pages or locales; apt keeps no lists or .debs), and
#      committed locally as localhost/debian:bookworm-slim;
#   2. examples/kubernetes/Dockerfile, unchanged (the same file `docker build` takes), is built by
#      buildah with --isolation chroot and --pull=never, tagged usproxy:<version in pyproject.toml>.
# The base's root file system is cached as a tarball (USPROXY_IMAGE_CACHE, default
# /var/cache/usproxy-image), keyed by suite, architecture and mirror, for 7 days; buildah's layer
# cache keeps the apt layers while the base is the same. As root (buildah needs it here).
#
# Usage: bash scripts/image.sh [--oci-archive PATH] [--docker-archive PATH] [--fresh]
#   --oci-archive PATH     also save the image as an OCI archive (skopeo/podman load read it)
#   --docker-archive PATH  also save it for `docker load`
#   --fresh                rebuild the base and every layer (no cache)
# Prints the tag, the image ID and its size on the last line: "usproxy:0.1.0 <id> <bytes>".
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=bookworm
BASE=localhost/debian:bookworm-slim
CACHE=${USPROXY_IMAGE_CACHE:-/var/cache/usproxy-image}
MAX_AGE_DAYS=7
OCI_ARCHIVE="" DOCKER_ARCHIVE="" FRESH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --oci-archive) OCI_ARCHIVE=$2; shift 2 ;;
    --docker-archive) DOCKER_ARCHIVE=$2; shift 2 ;;
    --fresh) FRESH=1; shift ;;
    *) echo "usage: $0 [--oci-archive PATH] [--docker-archive PATH] [--fresh]" >&2; exit 2 ;;
  esac
done
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "image.sh: $tool missing (bash scripts/setup.sh installs it)" >&2; exit 1; }
done

VERSION=$(sed -n 's/^version *= *"\(.*\)"$/\1/p' pyproject.toml | head -n1)
TAG=usproxy:$VERSION
ARCH=$(dpkg --print-architecture)

# The mirrors apt uses here (deb822 .sources or one-line .list), for the suite and its security suite.
mirrors() {
  python3 - "$SUITE" <<'EOF'
import glob, re, sys
suite = sys.argv[1]
found = {}
def note(uris, suites):
    for s in suites:
        for u in uris:
            found.setdefault(s, u.rstrip("/"))
for path in glob.glob("/etc/apt/sources.list.d/*.sources"):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = dict((k.strip().lower(), v.split()) for k, v in re.findall(r"^([\w-]+):(.*)$", stanza, re.M))
        if "deb" in fields.get("types", []) and fields.get("enabled", ["yes"]) != ["no"]:
            note(fields.get("uris", []), fields.get("suites", []))
for path in ["/etc/apt/sources.list", *glob.glob("/etc/apt/sources.list.d/*.list")]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
        if len(words) >= 3 and words[0] == "deb":
            note([words[1]], [words[2]])
main = found.get(suite, "http://deb.debian.org/debian")
security = found.get(f"{suite}-security", "http://deb.debian.org/debian-security")
print(main, security)
EOF
}
read -r MIRROR SECURITY < <(mirrors)
KEY=$(printf '%s %s %s %s' "$SUITE" "$ARCH" "$MIRROR" "$SECURITY" | sha256sum | cut -c1-12)
TARBALL=$CACHE/debian-$SUITE-minbase-$ARCH-$KEY.tar

# Debian's slim image: dpkg leaves out docs, man pages and locales; apt keeps no .debs or lists.
slim() {
  local root=$1
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
EOF
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/{man,groff,info,lintian,locale}/* "$root"/var/cache/apt/archives/*.deb \
    "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/log/apt/* \
    "$root"/tmp/* "$root"/etc/hostname "$root"/etc/resolv.conf
  : >"$root/etc/machine-id"
}

WORK="" BUILD_HOME="" BUILD_LOG=""
cleanup() { rm -rf "$WORK" "$BUILD_HOME" "$BUILD_LOG"; }
trap cleanup EXIT

make_tarball() {
  WORK=$(mktemp -d /var/tmp/usproxy-debootstrap.XXXXXX)
  echo "== debootstrap --variant=minbase $SUITE from $MIRROR" >&2
  debootstrap --variant=minbase --arch="$ARCH" "$SUITE" "$WORK/root" "$MIRROR" >"$WORK/log" 2>&1 \
    || { tail -n 20 "$WORK/log" >&2; return 1; }
  slim "$WORK/root"
  mkdir -p "$CACHE"
  tar -C "$WORK/root" --numeric-owner --xattrs -cf "$CACHE/.$(basename "$TARBALL").tmp" .
  # whole or absent: a killed run never leaves half a base under the cached name
  mv "$CACHE/.$(basename "$TARBALL").tmp" "$TARBALL"
  find "$CACHE" -name "debian-*.tar" -not -name "$(basename "$TARBALL")" -delete
  rm -rf "$WORK"
}

base_label() {
  buildah inspect --type image --format '{{index .OCIv1.Config.Labels "org.usproxy.base"}}' "$BASE" 2>/dev/null || true
}

if [ "$FRESH" = 1 ] || [ -z "$(find "$CACHE" -maxdepth 1 -name "$(basename "$TARBALL")" -mtime -"$MAX_AGE_DAYS" 2>/dev/null)" ]; then
  make_tarball
fi
STAMP="$(basename "$TARBALL")@$(stat -c %Y "$TARBALL")"
if [ "$(base_label)" != "$STAMP" ]; then
  echo "== $BASE from $(basename "$TARBALL")" >&2
  ctr=$(buildah from --quiet scratch)
  buildah add --quiet "$ctr" "$TARBALL" / >/dev/null
  buildah config --cmd bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --label "org.usproxy.base=$STAMP" "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE" >/dev/null
fi

# This machine may reach PyPI through a TLS-inspecting proxy whose CA only the host trusts: the
# RUN steps get the host's CA bundle for pip in a throwaway directory mounted over /root (root's
# pip reads ~/.config/pip/pip.conf). /root exists in the base, so no mount point is created and
# nothing of it stays in the image; the Dockerfile needs no change.
run_mounts=()
CA_BUNDLE=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$CA_BUNDLE" ]; then
  BUILD_HOME=$(mktemp -d /tmp/usproxy-build-home.XXXXXX)
  mkdir -p "$BUILD_HOME/.config/pip"
  cp "$CA_BUNDLE" "$BUILD_HOME/.config/pip/ca.crt"
  printf '[global]\ncert = /root/.config/pip/ca.crt\n' >"$BUILD_HOME/.config/pip/pip.conf"
  run_mounts=(--volume "$BUILD_HOME:/root")
fi

old_id=$(buildah images --quiet --no-trunc "$TAG" 2>/dev/null || true)
# images of earlier builds (of this base or an older one) that nothing tags: dropped after the
# build unless it reused them as its layer cache
stale=$(buildah images --all --quiet --no-trunc --filter dangling=true --filter label=org.usproxy.base 2>/dev/null || true)
cache_flag=--layers
[ "$FRESH" = 1 ] && cache_flag=--no-cache
echo "== buildah build -f examples/kubernetes/Dockerfile -t $TAG" >&2
start=$(date +%s)
BUILD_LOG=$(mktemp /tmp/usproxy-build.XXXXXX.log)
buildah build --isolation chroot --pull=never "$cache_flag" "${run_mounts[@]}" \
  -f examples/kubernetes/Dockerfile -t "$TAG" . 2>&1 | tee "$BUILD_LOG" >&2
new_id=$(buildah images --quiet --no-trunc "$TAG")
used=$(grep -o 'Using cache [0-9a-f]*' "$BUILD_LOG" | awk '{print $3}' || true)
for id in $stale $old_id; do
  [ "$id" = "$new_id" ] && continue
  grep -qx "${id#sha256:}" <<<"$used" && continue  # buildah prints full IDs
  buildah rmi "$id" >/dev/null 2>&1 || true  # refused while a kept image still builds on it
done
if [ -n "$OCI_ARCHIVE" ]; then buildah push --quiet "$TAG" "oci-archive:$OCI_ARCHIVE:$TAG"; fi
if [ -n "$DOCKER_ARCHIVE" ]; then buildah push --quiet "$TAG" "docker-archive:$DOCKER_ARCHIVE:$TAG"; fi
size=$(buildah images --format '{{.Size}}' "$TAG" | head -n1)
echo "== built in $(( $(date +%s) - start )) s: $TAG ($size)" >&2
ctr=$(buildah from --quiet --pull-never "$TAG")
mnt=$(buildah mount "$ctr")
bytes=$(du -sb "$mnt" | cut -f1)  # unpacked, as it lands on a node
buildah rm "$ctr" >/dev/null
echo "$TAG $new_id $bytes"
