"""The iptables datapath: kube-proxy's iptables mode, applied with iptables-restore.

Modules: `rules` (the generator: chains and rules per IP family, the same text `usproxy explain
--mode iptables` prints; a skeleton and one fragment per ServicePort), `jumps` (the entry jumps
from the built-in chains into them), `names` (the chains this mode owns), `family_ports` (a
ServicePortState as the generator's FamilyPort), `family_rules` (FamilyRules: the fragments kept
per ServicePort, and what a partial, full or chunked sync writes), `restore_input` (a table's
iptables-restore text), `saved` (iptables-save parsed), `readback` (what the kernel holds of this
mode, for adopting it at start), `leftovers` (removal that keeps every other program's rules,
mode-free so the IPVS mode's helper chains can use it), `backend` (iptables-nft or
iptables-legacy, as the node uses, and their tools), `nfacct` (kube-proxy's counters over
netlink), `client` (the tools run in the agent's network namespace), `datapath`
(IptablesDatapath, the KernelDatapath), `fake` (FakeIptablesClient, for unit tests) and
`declaration` (the registry entry, light to import). All but `client`, `nfacct` and `datapath`
are pure.

The datapath adds two things kube-proxy's iptables mode does not have, because usproxy's
ClusterIPs are local addresses on the ClusterIP interface: a jump from filter INPUT to
KUBE-SERVICES (jumps.LOCAL_CLUSTER_IPS) and, where nothing else masquerades it, a node process's
connection from the ClusterIP itself marked for masquerade (rules.SERVICE_ADDRESS_SOURCE).
`usproxy explain` prints kube-proxy's rules without them.
"""
