"""The VM lab (issue 26): boots Debian's own 6.1 kernel under qemu with features really taken away
(nf_tables, ip_tables, cgroup v2), on an edge-sized machine and on an emulated arm64 board, and runs
a usproxy scenario inside with real traffic.

Host side (this package, standard library only, so it runs before any venv exists):
- rootfs.py   builds and caches a bookworm root file system per architecture (debootstrap,
              Debian's kernel and modules, nftables, iptables, ipvsadm, conntrack, python3 and a
              venv with usproxy's dependencies), as an ext4 image plus the kernel to boot;
- machine.py  boots one guest: qemu (TCG unless KVM is shown to work), the root image read-only
              with a throwaway overlay, an input disk (a tar of lab/guest, usproxy's wheel and
              optionally the repository) and an output disk the guest writes its results to;
- scenarios.py  what each scenario is: architecture, vCPUs, memory, modules blacklisted, cgroups;
- __main__.py the command behind scripts/vm.sh.

Guest side: lab/guest/ (copied in at every boot, so editing it needs no rebuild). The guest has no
network to the host or anywhere: results come back on the output disk, progress on the serial
console.
"""
