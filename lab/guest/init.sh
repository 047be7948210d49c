#!/bin/sh
# PID 1 of a lab guest (after the initramfs): mount what a node has, lay out cgroups as the
# scenario says, install this run's usproxy wheel, run the scenario (or --run's command), write
# /lab/out onto the output disk (vdc) and power off. Everything the host learns comes from vdc
# and the console; the guest has no network device.
export PATH=/opt/usproxy/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
. /lab/params.sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /run /tmp
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=755 tmpfs /run
mount -t tmpfs -o size=64m tmpfs /tmp
mount -t tmpfs -o size=16m tmpfs /dev/shm
# cgroups as the scenario says: v2 = cgroup2 alone at /sys/fs/cgroup (systemd's unified hierarchy);
# hybrid = v1 controllers plus cgroup2 at /sys/fs/cgroup/unified; v1 = the v1 controllers only
if [ "$LAB_CGROUPS" = v2 ]; then
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
else
  mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup
  for c in cpu,cpuacct memory pids devices freezer; do
    mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c
  done
  if [ "$LAB_CGROUPS" = hybrid ]; then
    mkdir -p /sys/fs/cgroup/unified && mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified
  fi
fi
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
hostname "lab-$LAB_SCENARIO"
ip link set lo up
mkdir -p /lab/out /run/netns
say() { echo "lab-guest: $*" > /dev/console; }
say "up $(cut -d' ' -f1 /proc/uptime)s: $(uname -r) $(uname -m), $(grep MemTotal /proc/meminfo | tr -s ' ')"
# a feature taken away: blacklisted on the kernel command line (modprobe refuses it) and its module
# file removed from this boot's overlay (so not even insmod of the file can bring it back)
for m in $LAB_REMOVE_MODULES; do find /lib/modules -name "$m.ko*" -delete; done
for m in $LAB_LOAD_MODULES; do modprobe "$m" || say "modprobe $m failed"; done
# the scenario's own .debs (lab/debs.py), not in the cached root
if [ -d /lab/debs ]; then
  dpkg -i /lab/debs/*.deb > /lab/out/dpkg.log 2>&1 || say "dpkg -i of the scenario's packages failed: $(tail -n 3 /lab/out/dpkg.log)"
fi
# A guest that hangs leaves nothing but its console: from here on the kernel's warnings and the
# backtraces of a soft lockup or RCU stall reach it in full (the boot stays quiet at loglevel=4)
echo 7 > /proc/sys/kernel/printk
echo 1 > /proc/sys/kernel/softlockup_all_cpu_backtrace 2>/dev/null || true
t0=$(cut -d' ' -f1 /proc/uptime)
pip install --disable-pip-version-check -q --no-deps --no-index --no-compile /lab/usproxy-*.whl > /lab/out/pip.log 2>&1 \
  || say "pip install of the wheel failed: $(tail -n 3 /lab/out/pip.log)"
say "usproxy wheel installed in $(awk -v t0="$t0" '{print $1 - t0}' /proc/uptime)s"
if [ -f /lab/run.sh ]; then
  say "--run: $(cat /lab/run.sh)"
  ln -sfn /opt/usproxy /lab/repo/.venv  # the tests start .venv/bin/usproxy, as on the host
  (cd /lab/repo && sh /lab/run.sh) > /lab/out/run.log 2>&1
  echo $? > /lab/out/run.rc
else
  python /lab/guest/scenario.py > /lab/out/scenario.log 2>&1
  echo $? > /lab/out/scenario.rc
fi
kill -9 -1 2>/dev/null  # whatever the run left (an agent on a thrashing machine): free its memory first
sleep 1
dmesg > /lab/out/dmesg.txt 2>&1
say "writing results"
tar -cf /dev/vdc -C /lab/out . && sync
say "done"
busybox poweroff -f 2>/dev/null || echo o > /proc/sysrq-trigger  # sysrq has no poweroff on arm64
sleep 60
