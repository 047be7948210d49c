"""usproxy: a Kubernetes Service proxy in Python.

Sources (static manifests, the Kubernetes API) feed a mode-free model (ServicePort, Endpoint,
change trackers); one Proxier sync decides where each ServicePort is served; datapaths (the
userspace relay, nftables and BPF offload) carry the bytes. See docs/architecture.md.
"""

__version__ = "0.1.0"
