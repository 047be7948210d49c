#!/bin/sh
# PID 1 of the arm64 build guest (lab/rootfs.py): debootstrap's second stage on this half-built root,
# then the venv at /opt/usproxy from the wheels the host downloaded, then power off. Prints
# "lab-stage2: ok" on the console only when every step passed; the host keeps the image only then.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive INITRD=No
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mount -o remount,rw /
step() { echo "lab-stage2: $*"; }
fail() { step "FAILED: $*"; sync; echo o > /proc/sysrq-trigger; sleep 30; }
step "debootstrap --second-stage"
/debootstrap/debootstrap --second-stage >/var/tmp/second-stage.log 2>&1 || { tail -n 30 /var/tmp/second-stage.log; fail "second stage"; }
step "venv and pip install"
python3 -m venv /opt/usproxy || fail venv
PIP_CONFIG_FILE=/dev/null /opt/usproxy/bin/pip install --disable-pip-version-check -q --no-index \
  --find-links /var/tmp/lab-wheels -r /var/tmp/lab-wheels/requirements.txt || fail "pip install"
rm -rf /var/tmp/lab-wheels /var/cache/apt/archives/*.deb /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* /usr/share/locale/*
rm -f /lab-stage2.sh
sync
step ok
echo o > /proc/sysrq-trigger
sleep 30
