"""The relay (datapath "userspace"): ClusterIPs as local addresses, listeners per ServicePort, TCP and UDP
relays, endpoint selection and session affinity. It records every flow in usproxy.flows."""
