"""The iptables datapath: kube-proxy's iptables mode, applied with iptables-restore.

`rules` generates the chains and rules (the same text `usproxy explain --mode iptables` prints),
`jumps` the entry jumps from the built-in chains into them.
"""
