/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The frontends the tc programs serve for packets from outside the node, and what each one
 * admits (included by sock_lb.c inside its tc section: it uses struct pkt, tc_pick and the
 * affinity helpers defined there). Layout mirrored in usproxy/offload/bpf/layout.py.
 *
 * Frontends, looked up in usp_services (the socket LB's map) as kube-proxy matches them:
 *   - a LoadBalancer ingress IP or externalIP with the ServicePort's port: its own entry
 *     (ip, port, proto), flagged F_TC_ONLY so the socket LB never translates it (a local
 *     connect() to an LB IP stays with nftables or the relay, which filter its sources);
 *   - a NodePort: NODEPORT_ANY (0.0.0.0) with the nodePort, for a destination in usp_tc_addrs.
 * An exact (ip, port) entry wins over the NodePort.
 *
 * Before a backend is picked (tc_admit), in kube-proxy's order (the firewall check runs at
 * dstnat-10, before any endpoint, pkg/proxy/nftables/proxier.go):
 *   1. F_SOURCE_RANGES (an LB IP frontend with loadBalancerSourceRanges): a source outside
 *      usp_tc_sources for the service id drops. NodePorts and externalIPs never carry the flag.
 *   2. count 0 with F_DROP_EMPTY (externalTrafficPolicy Local, endpoints only on other nodes):
 *      drops, as kube-proxy's "no local endpoints" drop.
 *   3. count 0 otherwise (no usable endpoint at all): passes to the stack, where nothing listens
 *      (the relay listens only while there are endpoints), so the kernel refuses at once as
 *      kube-proxy REJECTs (TCP RST, ICMP port unreachable for UDP); nothing is generated at tc.
 * sessionAffinity ClientIP (F_AFFINITY): usp_affinity keyed by the client's IPv4 address (in
 * the low 32 bits of the client field; the socket LB's entries are netns cookies, never under
 * the same service id, since tc frontends have groups of their own).
 */
#ifndef USP_TC_FRONTENDS_H
#define USP_TC_FRONTENDS_H

#define F_SOURCE_RANGES	(1U << 9)	/* LB IP frontend with loadBalancerSourceRanges */
#define F_DROP_EMPTY	(1U << 10)	/* count 0 means "no local endpoint": drop, never refuse */

#define TC_ADMIT	-1		/* tc_admit: serve the packet (pick a backend) */

struct src_range_key {
	__u32 prefixlen;		/* 32 (service id) + the range's prefix length */
	__u32 svc_id;
	__u32 addr;			/* IPv4 network, network order */
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct src_range_key);
	__type(value, __u32);
} usp_tc_sources SEC(".maps");

/* The service entry for the packet's destination, or NULL when it is none of ours. */
static __always_inline struct svc_val *tc_frontend(struct pkt *p)
{
	struct svc_key key = {};
	struct svc_val *svc;

	key_from_v4(&key, p->t.daddr, p->t.dport, p->t.proto);
	svc = bpf_map_lookup_elem(&usp_services, &key);
	if (svc && (svc->flags & F_TC_ONLY))
		return svc;
	if (!bpf_map_lookup_elem(&usp_tc_addrs, &p->t.daddr))
		return NULL;
	key_from_v4(&key, 0, p->t.dport, p->t.proto);
	return bpf_map_lookup_elem(&usp_services, &key);
}

/* TC_ADMIT, or the verdict for a packet this frontend refuses (see the header comment). */
static __always_inline int tc_admit(struct pkt *p, struct svc_val *svc)
{
	if (svc->flags & F_SOURCE_RANGES) {
		struct src_range_key k = { .prefixlen = 64, .svc_id = svc->id, .addr = p->t.saddr };

		if (!bpf_map_lookup_elem(&usp_tc_sources, &k))
			return TC_ACT_SHOT;
	}
	if (!svc->count)
		return (svc->flags & F_DROP_EMPTY) ? TC_ACT_SHOT : TC_ACT_OK;
	return TC_ADMIT;
}

/* A backend id for a new flow: the client's affine one while it lasts, else a fresh pick. */
static __always_inline __u32 tc_select(struct pkt *p, struct svc_val *svc, __u64 now)
{
	__u32 id;

	if (!(svc->flags & F_AFFINITY))
		return tc_pick(p, svc);
	id = affinity_get(svc, p->t.saddr, now);
	if (id && backend_of(svc, id))
		return id;
	id = tc_pick(p, svc);
	if (id)
		affinity_put(svc, p->t.saddr, now, id);
	return id;
}

#endif /* USP_TC_FRONTENDS_H */
