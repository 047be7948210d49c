/* SPDX-License-Identifier: GPL-2.0 */
/*
 * NodePort at XDP (--bpf-lb-acceleration native), included at the end of sock_lb.c: it uses the
 * tc section's maps (usp_ct, usp_tc_addrs, usp_tc_ifaces) and helpers (tc_pick, snat_port,
 * ct_create, ct_get), so a flow XDP starts is a flow tc knows and the other way round.
 *
 * The shape is Cilium's bpf_xdp.c with lib/nodeport.h under XDP acceleration (the code is
 * usproxy's): the same lookup, backend selection, DNAT and SNAT as usp_tc_ingress, done on the
 * driver's frame before an skb exists, for IPv4 TCP/UDP with a 20-byte IP header, no fragment and
 * no VLAN tag. XDP sends a frame only back out of the interface it came in on (XDP_TX), with the
 * MAC addresses bpf_fib_lookup gives: the common NodePort case (client and remote backend both
 * behind the node's uplink), client to backend (DNAT, SNAT) and backend to client (the reverse
 * NAT of the reply entry, xdp_reply). Everything else is XDP_PASS, and usp_tc_ingress serves it as
 * without XDP: a backend or client behind another interface (a pod bridge, which has no native
 * XDP), a next hop without a neighbour entry yet (tc's bpf_redirect_neigh resolves it), an expired
 * or stale ct entry (tc deletes it and selects again), a NodePort without endpoints, a Service
 * with sessionAffinity, DSR flows, LoadBalancer IPs and externalIPs (not usp_tc_addrs
 * destinations), and a frame with a partial L4 checksum (xdp_csum_partial).
 *
 * usp_xdp_stats counts per CPU what XDP did (XDP_STAT_*), for tests and the benchmark.
 *
 * Maglev for external flows: flow_hash() is the tuple hash tc_pick gives the Maglev table. It
 * leaves the destination address out: a NodePort is the same frontend at every node address, and
 * every node builds the same table from the same endpoints (maglev.py), so a client's flow picks
 * the same backend whichever node it enters (Cilium hashes the tuple for the same reason).
 */

#define XDP_STAT_NEW	0		/* new NodePort flow NATed and sent at XDP */
#define XDP_STAT_KNOWN	1		/* packet of a known flow sent at XDP */
#define XDP_STAT_PASS	2		/* a new NodePort flow left to tc */
#define XDP_STAT_REPLY	3		/* reply of a known flow reverse-NATed and sent at XDP */
#define XDP_STAT_PARTIAL 4		/* packet of a known flow with a partial checksum left to tc */
#define XDP_STATS	8		/* room for more; pins of the 3-entry map from before REPLY
					 * are reused as they are (bpf_map__reuse_fd takes the pinned
					 * map's shape): REPLY and PARTIAL stay uncounted there
					 * (the lookup fails) until --cleanup */

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDP_STATS);
	__type(key, __u32);
	__type(value, __u64);
} usp_xdp_stats SEC(".maps");

static __always_inline __u64 flow_hash(const struct pkt *p)
{
	return mix64(((__u64)p->t.saddr << 32) ^
		     ((__u64)p->t.sport << 24 | (__u64)p->t.dport << 8 | p->t.proto));
}

static __always_inline void xdp_count(__u32 what)
{
	__u64 *n = bpf_map_lookup_elem(&usp_xdp_stats, &what);

	if (n)
		*n += 1;	/* per CPU: no atomic needed */
}

/* The frame's headers, bounds-checked; NULL when XDP leaves the frame to tc. */
struct xdp_hdrs {
	struct ethhdr *eth;
	struct iphdr *ip;
	__u16 *ports;			/* source, destination */
	__u16 *csum;			/* L4 checksum; NULL: UDP without one */
};

static __always_inline int xdp_parse(struct xdp_md *ctx, struct xdp_hdrs *h, struct pkt *p)
{
	void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	__u8 *l4 = (void *)(ip + 1);

	if ((void *)(ip + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return -1;
	if (ip->version != 4 || ip->ihl != 5 || (ip->frag_off & bpf_htons(IP_FRAG_MASK)))
		return -1;
	if ((void *)ip + bpf_ntohs(ip->tot_len) > end)
		return -1;	/* a truncated packet: the stack drops it */
	if (ip->protocol == IPPROTO_TCP) {
		if (l4 + 20 > (__u8 *)end || bpf_ntohs(ip->tot_len) < sizeof(*ip) + 20)
			return -1;
		h->csum = (__u16 *)(l4 + TCP_CSUM_OFF);
		p->tcp_flags = l4[TCP_FLAGS_OFF];
	} else if (ip->protocol == IPPROTO_UDP) {
		if (l4 + 8 > (__u8 *)end || bpf_ntohs(ip->tot_len) < sizeof(*ip) + 8)
			return -1;
		h->csum = *(__u16 *)(l4 + UDP_CSUM_OFF) ? (__u16 *)(l4 + UDP_CSUM_OFF) : NULL;
	} else {
		return -1;
	}
	h->eth = eth;
	h->ip = ip;
	h->ports = (__u16 *)l4;
	p->t.saddr = ip->saddr;
	p->t.daddr = ip->daddr;
	p->t.sport = h->ports[0];
	p->t.dport = h->ports[1];
	p->t.proto = ip->protocol;
	p->t.dir = CT_ORIGINAL;
	return 0;
}

static __always_inline void l4_csum(struct xdp_hdrs *h, __u8 proto, __u16 sum)
{
	if (!h->csum)
		return;
	if (proto == IPPROTO_UDP && !sum)
		sum = 0xffff;	/* 0 means "no checksum" in UDP */
	*h->csum = sum;
}

/* Whether the L4 checksum is a partial one: the folded pseudo-header sum a sender with checksum
 * offload leaves for the device to complete (__tcp_v4_send_check, udp4_hwcsum; CHECKSUM_PARTIAL).
 * No wire delivers one, but a veth hands XDP the skb of a local sender as it is, and XDP cannot
 * finish it: the frame XDP_TX sends becomes an skb with CHECKSUM_NONE at the peer, whose stack
 * then drops it as corrupt (TcpInCsumErrors). tc can (bpf_l4_csum_replace knows the skb's state),
 * so such frames pass. A complete checksum equal to the pseudo-header sum (1 in 65536) passes too:
 * tc serves it as well. */
static __always_inline int xdp_csum_partial(const struct xdp_hdrs *h)
{
	__u32 s, l4len;

	if (!h->csum)
		return 0;
	l4len = bpf_ntohs(h->ip->tot_len) - sizeof(struct iphdr);
	s = (h->ip->saddr & 0xffff) + (h->ip->saddr >> 16) + (h->ip->daddr & 0xffff) +
	    (h->ip->daddr >> 16) + bpf_htons((__u16)h->ip->protocol) + bpf_htons((__u16)l4len);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return *h->csum == (__u16)s;
}

/* Rewrite the frame's tuple to (saddr:sport -> daddr:dport), both checksums updated. */
static __always_inline void xdp_rewrite(struct xdp_hdrs *h, struct pkt *p, __u32 saddr, __u16 sport,
					__u32 daddr, __u16 dport)
{
	__u16 l4 = h->csum ? *h->csum : 0;

	h->ip->check = csum_add32(csum_add32(h->ip->check, p->t.saddr, saddr), p->t.daddr, daddr);
	l4 = csum_add32(csum_add32(l4, p->t.saddr, saddr), p->t.daddr, daddr);
	l4 = csum_add16(csum_add16(l4, p->t.sport, sport), p->t.dport, dport);
	l4_csum(h, p->t.proto, l4);
	h->ip->saddr = saddr;
	h->ip->daddr = daddr;
	h->ports[0] = sport;
	h->ports[1] = dport;
}

/* The route to `daddr` when it leaves through the interface the frame came in on and its next
 * hop's MAC is known; 0 and `fib` filled, else -1 (tc's bpf_redirect_neigh does the rest). */
static __always_inline int xdp_route(struct xdp_md *ctx, struct xdp_hdrs *h, __u32 saddr, __u32 daddr,
				     struct bpf_fib_lookup *fib)
{
	fib->family = AF_INET_;
	fib->l4_protocol = h->ip->protocol;
	fib->tot_len = bpf_ntohs(h->ip->tot_len);
	fib->ipv4_src = saddr;
	fib->ipv4_dst = daddr;
	fib->ifindex = ctx->ingress_ifindex;
	if (bpf_fib_lookup(ctx, fib, sizeof(*fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return -1;
	return fib->ifindex == ctx->ingress_ifindex ? 0 : -1;
}

static __always_inline int xdp_send(struct xdp_hdrs *h, struct bpf_fib_lookup *fib, __u32 stat)
{
	__builtin_memcpy(h->eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(h->eth->h_source, fib->smac, ETH_ALEN);
	xdp_count(stat);
	return XDP_TX;
}

/* A live confirmed entry without touching it: XDP refreshes an entry only once it sends the frame,
 * and leaves expired ones to tc (which deletes them), as it leaves flows not yet confirmed (tc
 * confirms them: ct_saw_reply, ct_try_confirm). */
static __always_inline struct ct_val *ct_peek(struct ct_key *k, __u64 now)
{
	struct ct_val *v = ct_confirmed(k);

	if (!v || v->last + ct_lifetime(v, k->proto, 0) <= now)
		return NULL;
	return v;
}

/* XDP_PASS when `k` has an entry not yet confirmed (tc's), else -1. */
static __always_inline int xdp_pending(struct ct_key *k)
{
	return bpf_map_lookup_elem(&usp_ct_new, k) ? XDP_PASS : -1;
}

/* A reply of a known flow, reverse-NATed (backend -> SNAT address becomes NodePort -> client) and
 * sent back out with XDP_TX, as reply_nat at tc; XDP_PASS when tc must (DSR entries, a client not
 * behind this interface or without a neighbour entry); -1 when the packet is no reply. */
static __always_inline int xdp_reply(struct xdp_md *ctx, struct xdp_hdrs *h, struct pkt *p, __u64 now)
{
	struct bpf_fib_lookup fib = {};
	struct ct_new_val *pending;
	struct ct_key k = p->t;
	struct ct_val *v;

	k.dir = CT_REPLY;
	v = ct_peek(&k, now);
	if (!v)
		return xdp_pending(&k);
	if (v->flags & CT_DSR)
		return XDP_PASS;
	if (xdp_csum_partial(h)) {
		xdp_count(XDP_STAT_PARTIAL);
		return XDP_PASS;
	}
	if (xdp_route(ctx, h, v->nat_saddr, v->nat_daddr, &fib) < 0 || !ct_get(&k, p, now, &pending))
		return XDP_PASS;
	xdp_rewrite(h, p, v->nat_saddr, v->nat_sport, v->nat_daddr, v->nat_dport);
	return xdp_send(h, &fib, XDP_STAT_REPLY);
}

/* A packet of a known flow whose backend is still the Service's: -1 when there is none. */
static __always_inline int xdp_known(struct xdp_md *ctx, struct xdp_hdrs *h, struct pkt *p, __u64 now)
{
	struct bpf_fib_lookup fib = {};
	struct ct_new_val *pending;
	struct backend_val *be;
	struct ct_val *v = ct_peek(&p->t, now);

	if (!v)
		return xdp_pending(&p->t);
	if (v->flags & CT_DSR)	/* dsr_known at tc: the option again on a retransmitted SYN, UDP */
		return XDP_PASS;
	if ((v->flags & CT_CLOSING) && ct_may_open(p))
		return XDP_PASS;	/* a SYN reusing a closed flow's tuple: tc opens a new flow */
	be = bpf_map_lookup_elem(&usp_backends, &v->backend_id);
	if (!be || be->addr[3] != v->nat_daddr || (__u16)be->port != v->nat_dport)
		return XDP_PASS;
	if (xdp_csum_partial(h)) {
		xdp_count(XDP_STAT_PARTIAL);
		return XDP_PASS;
	}
	if (xdp_route(ctx, h, v->nat_saddr ? v->nat_saddr : p->t.saddr, v->nat_daddr, &fib) < 0 ||
	    !ct_get(&p->t, p, now, &pending))
		return XDP_PASS;
	xdp_rewrite(h, p, v->nat_saddr ? v->nat_saddr : p->t.saddr, v->nat_saddr ? v->nat_sport : p->t.sport,
		    v->nat_daddr, v->nat_dport);
	return xdp_send(h, &fib, XDP_STAT_KNOWN);
}

/* A new flow to a NodePort, as nodeport_new at tc; XDP_PASS for everything it leaves to tc. */
static __always_inline int xdp_new(struct xdp_md *ctx, struct xdp_hdrs *h, struct pkt *p, __u64 now)
{
	struct bpf_fib_lookup fib = {};
	struct svc_key key = {};
	struct backend_val *be;
	struct svc_val *svc;
	__u32 id, snat = 0, *ifaddr;
	__u16 sport = p->t.sport;

	if (!bpf_map_lookup_elem(&usp_tc_addrs, &p->t.daddr))
		return XDP_PASS;
	key_from_v4(&key, 0, p->t.dport, p->t.proto);
	svc = bpf_map_lookup_elem(&usp_services, &key);
	if (!svc)
		return XDP_PASS;
	if (!svc->count || (svc->flags & (F_AFFINITY | F_DSR)) || xdp_csum_partial(h) || !ct_may_open(p))
		goto to_tc;	/* DSR writes an IP option; a segment that opens no flow: tc's */
	id = tc_pick(p, svc);
	be = backend_of(svc, id);
	if (!be || !is_v4_mapped(be->addr) || xdp_route(ctx, h, p->t.saddr, be->addr[3], &fib) < 0)
		goto to_tc;
	ifaddr = bpf_map_lookup_elem(&usp_tc_ifaces, &fib.ifindex);
	if (ifaddr && !(svc->flags & F_LOCAL_ONLY)) {
		snat = *ifaddr;
		sport = snat_port(p, snat, be->addr[3], (__u16)be->port);
		if (!sport)
			goto to_tc;
	}
	__sync_fetch_and_add(&be->selected, 1);
	if (ct_create(p, svc, id, be, snat, sport, now) < 0)
		goto to_tc;
	xdp_rewrite(h, p, snat ? snat : p->t.saddr, sport, be->addr[3], (__u16)be->port);
	return xdp_send(h, &fib, XDP_STAT_NEW);
to_tc:
	xdp_count(XDP_STAT_PASS);
	return XDP_PASS;
}

SEC("xdp")
int usp_xdp(struct xdp_md *ctx)
{
	__u64 now = bpf_ktime_get_ns();
	struct xdp_hdrs h = {};
	struct pkt p = {};
	int ret;

	if (xdp_parse(ctx, &h, &p) < 0)
		return XDP_PASS;
	ret = xdp_reply(ctx, &h, &p, now);
	if (ret >= 0)
		return ret;
	ret = xdp_known(ctx, &h, &p, now);
	if (ret >= 0)
		return ret;
	return xdp_new(ctx, &h, &p, now);
}
