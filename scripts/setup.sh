#!/usr/bin/env bash
# Set-up from a fresh Debian 12 machine (as root): system packages, .venv at the repo root, the
# package and its test tools. Safe to run again; it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  python3 python3-venv python3-pip      # the agent's interpreter (3.11 on Debian 12)
  iproute2 procps                       # ip netns, veth, bridges; sysctl
  nftables libnftables1 conntrack iptables   # kernel datapaths and their tools
  clang llvm libbpf-dev libbpf1 linux-libc-dev   # BPF programs (compiled at set-up)
  dnsmasq-base dnsutils curl            # the demo's DNS pod, dig, curl
  haproxy                               # the userspace peer in bench/
  wrk iperf3 redis-server redis-tools nginx-light   # bench/tools.py: the real tools and their servers
  debootstrap buildah openssl systemd   # scripts/image.sh and tests/deploy (image, TLS API server, systemd-analyze)
  chromium                              # the web view tests (tests/offload/test_web_view_browser.py): headless
  qemu-system-x86 qemu-system-arm cpio  # the VM lab (scripts/vm.sh, tests/vm): guests under qemu, their initramfs
  qemu-user-static                      # the VM lab's arm64 root: its programs run in a chroot while it is built
)

need_apt=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
done
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "== apt-get install ${need_apt[*]}"
  apt-get update -qq
  # The servers bench/ needs (nginx, redis, haproxy) are started by bench itself in its own network
  # namespaces: keep their packages from starting node-wide daemons (which would also hold ports on
  # every local address, ClusterIPs included). policy-rc.d is Debian's switch for that.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
    made_policy=1
    trap 'rm -f "$policy"' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  if [ -n "${made_policy:-}" ]; then rm -f "$policy"; trap - EXIT; fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import usproxy, pytest, scipy" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  echo "== pip install -e .[test]"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
  touch .venv/.installed
fi
if [ -f usproxy/offload/bpf/build.py ]; then
  .venv/bin/python -m usproxy.offload.bpf.build || echo "warning: BPF programs did not build; the BPF datapath will report itself unavailable"
fi
# The VM lab's root file systems (kernels, modules, Debian roots with the lab's Python packages):
# cached under USPROXY_LAB_CACHE (default /var/cache/usproxy-lab), so a re-run only checks the
# cache (under a second). Cold, both built at once: about 9 minutes under load (docs/lab.md).
# USPROXY_LAB_BUILD=0 skips them (tests/vm then builds them on first use).
if [ "${USPROXY_LAB_BUILD:-1}" != 0 ]; then
  echo "== VM lab roots (bash scripts/vm.sh build amd64 / arm64, side by side; cached)"
  pids=()
  for arch in amd64 arm64; do
    bash scripts/vm.sh build "$arch" > "/tmp/usproxy-lab-setup-$arch.log" 2>&1 &
    pids+=("$!")
  done
  for i in 0 1; do
    arch=$([ "$i" = 0 ] && echo amd64 || echo arm64)
    wait "${pids[$i]}" || { tail -n 20 "/tmp/usproxy-lab-setup-$arch.log"
      echo "warning: the VM lab's $arch root did not build (log: /tmp/usproxy-lab-setup-$arch.log); tests/vm will try again"; }
  done
fi
echo "== set-up done: .venv/bin/usproxy"
