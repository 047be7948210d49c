/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Direct server return at tc (--bpf-lb-mode dsr) for NodePorts, LoadBalancer IPs and externalIPs,
 * as Cilium's, included by sock_lb.c after its tc section: it uses that section's struct pkt, the
 * conntrack tables, rewrite() and send().
 *
 * The shape is Cilium's IPv4 DSR with an IP option (bpf/lib/nodeport.h: dsr_set_opt4 and
 * handle_dsr_v4, option type IPOPT_COPY | 26, 8 bytes: type, length, port, address); the code is
 * usproxy's.
 *
 * Ingress node (the node the client addressed): a new flow to a frontend flagged F_DSR whose
 * backend is reached through a gateway (another node: the route to its pod network goes via that
 * node) is DNATed without SNAT, so the client's address stays; the packet gets the service address
 * (the address and port the client addressed: node address and NodePort, or an LB IP or externalIP
 * and the Service's port) as an IP option after the 20-byte header and leaves through
 * bpf_fib_lookup + bpf_redirect_neigh. Only an ORIGINAL entry (flag CT_DSR) is written: the reply
 * never comes back through this node, so the entry is never confirmed and stays in usp_ct_new, a
 * cache of the choice: once it is gone, a segment of the flow goes again to the backend the Maglev
 * table names, without an entry (dsr_stateless). TCP carries the option on SYNs only (a SYN has
 * no payload, so the 8 bytes never push a segment past the MTU); the backend node remembers the
 * flow from it. UDP has no handshake to remember from, so every datagram carries it when it fits:
 * the first packet of a flow that would no longer fit the route's MTU with the 8 bytes is served
 * with SNAT instead (the whole flow), a later datagram that would not fit goes without the option
 * (the backend's node knows the flow from the earlier ones, while its entry lives); so does every
 * fragment. Cilium answers ICMP fragmentation-needed there instead.
 *
 * Backend node, and what it trusts (issue 29). A DSR packet carries the client's address (that is
 * the point), so nothing in it proves that another node of the cluster sent it: any host that
 * reaches a pod's address can write the option. The node accepts an option only where it can be
 * genuine, and only on a packet that opens a flow:
 *   - it names a frontend this node serves in DSR mode: an LB IP or externalIP entry of its own
 *     for that address and port, or a NodePort for that port at a peer node's address: one in
 *     usp_dsr_peers (the node networks: the --nodeport-addresses CIDRs and the networks of this
 *     node's own NodePort addresses, written by the agent), not one of this node's own, and
 *     reached through the interface the packet came in on (a peer sends from there);
 *   - the packet's destination is a backend of that frontend's Service (usp_backend_ids);
 *   - it is a TCP SYN (no ACK, RST or FIN) or a UDP datagram, and no live DSR entry holds its
 *     tuple: a REPLY entry is written once, from the flow's first packet, and no later packet
 *     rewrites it. A SYN ends it only once it is closing (the pod sent a FIN or RST: the client
 *     reuses its port), and then records a new DSR flow with a genuine option, or leaves a direct
 *     connection without one (as Cilium's nodeport_extract_dsr_v4 clears the DSR flag on a SYN
 *     without DSR info).
 * So a forged option makes a pod answer one new connection as a frontend of the pod's own Service
 * at an address of the cluster: what its author gets by sending that SYN to the frontend itself.
 * It never makes the node send from another address, nor moves a live flow.
 * The REPLY entry (backend:port -> client, naming the service address) starts in usp_ct_new and is
 * confirmed as any flow: the pod's SYN-ACK, then the client's ACK of it (UDP: a reply, then another
 * datagram). reply_nat rewrites the reply's source to the service address where the reply first
 * meets a hooked interface (the pod bridge's ingress) and sends it straight to the client; the
 * pod's FIN or RST marks the entry closing there (ct_touch), so it ends CT_LIFETIME_CLOSING after
 * the close. A UDP datagram without the option leaves the
 * entry alone, as Cilium's does (it only acts on SYNs): UDP has no handshake telling a new flow
 * from the datagrams of a DSR flow sent without the option because they would not fit with it.
 */
#ifndef USP_DSR_H
#define USP_DSR_H

#define F_DSR		(1U << 12)	/* NodePort in --bpf-lb-mode dsr */
#define CT_DSR		(1U << 1)	/* ct flag: a DSR flow (no SNAT, reply not through here) */

#define DSR_OPT_TYPE	(0x80 | 0x1a)	/* copied on fragmentation, control class, number 26 */
#define DSR_OPT_LEN	8
#define IP_HLEN_BASE	20

struct peer_key {
	__u32 prefixlen;
	__u32 addr;			/* network order */
};

/* The node networks: where the peers that send DSR packets have their NodePort addresses. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct peer_key);
	__type(value, __u32);
} usp_dsr_peers SEC(".maps");

struct dsr_opt {
	__u8 type;
	__u8 len;
	__u16 port;			/* the port the client addressed (NodePort or Service port), network order */
	__u32 addr;			/* the address the client addressed (node, LB IP, externalIP), network order */
};

struct dsr_iphdr {
	struct iphdr ip;
	struct dsr_opt opt;
};

/* The route to `daddr`: its interface (0: none) and whether it goes through a gateway. */
static __always_inline __u32 dsr_route(struct __sk_buff *skb, __u32 saddr, __u32 daddr, __u16 tot_len,
				       int *via_gw, int *too_big)
{
	struct bpf_fib_lookup fib = {};
	long rc;

	fib.family = AF_INET_;
	fib.ipv4_src = saddr;
	fib.ipv4_dst = daddr;
	fib.tot_len = tot_len;
	fib.ifindex = skb->ifindex;
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_SKIP_NEIGH);
	*too_big = rc == BPF_FIB_LKUP_RET_FRAG_NEEDED;
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	*via_gw = fib.ipv4_dst != daddr;	/* the lookup puts the next hop there */
	return fib.ifindex;
}

static __always_inline int dsr_wants_opt(const struct pkt *p)
{
	return p->t.proto == IPPROTO_UDP || (p->tcp_flags & TCP_SYN);
}

/* Insert the option after the 20-byte header (the packet has none: checked by the caller) and fix
 * the header's length fields and checksum; the L4 checksum does not cover IP options. */
static __always_inline int dsr_add_opt(struct __sk_buff *skb, __u32 addr, __u16 port)
{
	struct dsr_iphdr h = {};
	__s64 sum;

	if (bpf_skb_adjust_room(skb, DSR_OPT_LEN, BPF_ADJ_ROOM_NET, 0) < 0)
		return -1;
	if (bpf_skb_load_bytes(skb, IP_OFF, &h.ip, sizeof(h.ip)) < 0)
		return -1;
	h.ip.ihl = (IP_HLEN_BASE + DSR_OPT_LEN) / 4;
	h.ip.tot_len = bpf_htons(bpf_ntohs(h.ip.tot_len) + DSR_OPT_LEN);
	h.ip.check = 0;
	h.opt.type = DSR_OPT_TYPE;
	h.opt.len = DSR_OPT_LEN;
	h.opt.port = port;
	h.opt.addr = addr;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&h, sizeof(h), 0);
	if (sum < 0)
		return -1;
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	h.ip.check = (__u16)~sum;
	return bpf_skb_store_bytes(skb, IP_OFF, &h, sizeof(h), 0);
}

/* Whether the packet still fits the route to the backend with the option added. */
static __always_inline int dsr_opt_fits(struct __sk_buff *skb, struct pkt *p, __u32 be_addr, int *via_gw)
{
	__u16 len = (__u16)(skb->len - ETH_HLEN + DSR_OPT_LEN);
	int too_big = 0;

	return dsr_route(skb, p->t.saddr, be_addr, len, via_gw, &too_big) && !too_big;
}

/* DNAT to the backend keeping the client's address, add the option when `opt`, send. The option
 * names the frontend the client addressed (p->t as parsed, before the rewrite). */
static __always_inline int dsr_forward(struct __sk_buff *skb, struct pkt *p, __u32 be_addr, __u16 be_port,
				       int opt)
{
	__u32 front = p->t.daddr;
	__u16 front_port = p->t.dport;

	if (rewrite(skb, p, p->t.saddr, p->t.sport, be_addr, be_port) < 0)
		return TC_ACT_SHOT;
	if (opt && dsr_add_opt(skb, front, front_port) < 0)
		return TC_ACT_SHOT;
	return send(skb, p->t.saddr, be_addr);
}

/* Whether `addr` is a peer node's address as a DSR packet arriving here may name it: in
 * usp_dsr_peers, not this node's own, and reached through the interface the packet came in on. */
static __always_inline int dsr_peer(struct __sk_buff *skb, struct pkt *p, __u32 addr)
{
	struct peer_key k = { .prefixlen = 32, .addr = addr };

	if (!bpf_map_lookup_elem(&usp_dsr_peers, &k) || bpf_map_lookup_elem(&usp_tc_addrs, &addr))
		return 0;
	return route_ifindex(skb, p->t.saddr, addr) == skb->ifindex;
}

/* The DSR frontend an option names, as this node serves it: the LB IP or externalIP entry for
 * (addr, port), else the NodePort `port` at a peer's address; NULL when neither is flagged F_DSR. */
static __always_inline struct svc_val *dsr_frontend(struct __sk_buff *skb, struct pkt *p, struct dsr_opt *opt)
{
	struct svc_key key = {};
	struct svc_val *svc;

	key_from_v4(&key, opt->addr, opt->port, p->t.proto);
	svc = bpf_map_lookup_elem(&usp_services, &key);
	if (svc && (svc->flags & F_TC_ONLY) && (svc->flags & F_DSR))
		return svc;
	if (!dsr_peer(skb, p, opt->addr))
		return NULL;
	key_from_v4(&key, 0, opt->port, p->t.proto);
	svc = bpf_map_lookup_elem(&usp_services, &key);
	return svc && (svc->flags & F_DSR) ? svc : NULL;
}

/* Whether the packet's destination is a backend of `svc` (usp_backend_ids). */
static __always_inline int dsr_backend_of(struct pkt *p, struct svc_val *svc)
{
	struct backend_key k = { .svc_id = svc->id, .port = p->t.dport };

	k.addr[2] = bpf_htonl(0x0000ffff);
	k.addr[3] = p->t.daddr;
	return bpf_map_lookup_elem(&usp_backend_ids, &k) != NULL;
}

/* The DSR frontend the packet's option (first of its header) names, when the option can be
 * genuine (see the top of this file), with the option in `opt`; NULL otherwise. */
static __always_inline struct svc_val *dsr_opt_frontend(struct __sk_buff *skb, struct pkt *p,
							 struct dsr_opt *opt)
{
	struct svc_val *svc;

	if (p->frag != FRAG_NONE || p->l4_off < IP_OFF + IP_HLEN_BASE + DSR_OPT_LEN)
		return NULL;
	if (bpf_skb_load_bytes(skb, IP_OFF + IP_HLEN_BASE, opt, sizeof(*opt)) < 0)
		return NULL;
	if (opt->type != DSR_OPT_TYPE || opt->len != DSR_OPT_LEN)
		return NULL;
	svc = dsr_frontend(skb, p, opt);
	return svc && dsr_backend_of(p, svc) ? svc : NULL;
}

/* A new flow to a DSR frontend (nodeport_new's hook): -1 when DSR does not apply (the backend is
 * on this node, the packet already has IP options, is a fragment or would not fit with the
 * option) and the SNAT path goes on. */
static __always_inline int dsr_new(struct __sk_buff *skb, struct pkt *p, struct svc_val *svc,
				   __u32 be_id, struct backend_val *be, __u64 now)
{
	struct ct_new_val fv = { .v = { .nat_daddr = be->addr[3], .nat_dport = (__u16)be->port,
					.svc_id = svc->id, .backend_id = be_id, .flags = CT_DSR,
					.created = now, .last = now, .packets = 1 } };
	int via_gw = 0;

	if (!(svc->flags & F_DSR) || (svc->flags & F_LOCAL_ONLY) || p->l4_off != IP_OFF + IP_HLEN_BASE ||
	    p->frag != FRAG_NONE)
		return -1;
	if (!dsr_opt_fits(skb, p, be->addr[3], &via_gw) || !via_gw)
		return -1;
	__sync_fetch_and_add(&be->selected, 1);
	ct_confirmed_delete(&p->t);
	if (bpf_map_update_elem(&usp_ct_new, &p->t, &fv, BPF_ANY) < 0)
		return TC_ACT_SHOT;
	return dsr_forward(skb, p, be->addr[3], (__u16)be->port, dsr_wants_opt(p));
}

/* A packet of a known DSR flow (nodeport_known's hook, entry `v` already checked): DNAT, and the
 * option again on a retransmitted SYN and on every whole UDP datagram that fits with it. -1 for a
 * flow that is not DSR. */
static __always_inline int dsr_known(struct __sk_buff *skb, struct pkt *p, struct ct_val *v)
{
	int opt = dsr_wants_opt(p) && p->frag == FRAG_NONE, via_gw = 0;

	if (!(v->flags & CT_DSR))
		return -1;
	if (opt && p->l4_off != IP_OFF + IP_HLEN_BASE)
		return TC_ACT_SHOT;
	if (opt && !dsr_opt_fits(skb, p, v->nat_daddr, &via_gw))
		opt = 0;
	return dsr_forward(skb, p, v->nat_daddr, v->nat_dport, opt);
}

/* A segment of a flow no table holds, to a frontend (nodeport_new's, for what may not open a
 * flow): at a DSR frontend, the backend the Maglev table (or the client's affinity) names, when it
 * is on another node, gets it DNATed without an entry and without the option (its node holds the
 * flow). Otherwise TC_ACT_OK: the stack resets the segment. */
static __always_inline int dsr_stateless(struct __sk_buff *skb, struct pkt *p, struct svc_val *svc, __u64 now)
{
	struct backend_val *be;
	int via_gw = 0, too_big = 0;
	__u32 id = 0;

	if (!(svc->flags & F_DSR) || (svc->flags & F_LOCAL_ONLY) || p->frag != FRAG_NONE)
		return TC_ACT_OK;
	if (svc->flags & F_AFFINITY)
		id = affinity_get(svc, p->t.saddr, now);
	be = backend_of(svc, id ? id : tc_pick(p, svc));
	if (!be || !is_v4_mapped(be->addr))
		return TC_ACT_OK;
	if (!dsr_route(skb, p->t.saddr, be->addr[3], 0, &via_gw, &too_big) || !via_gw)
		return TC_ACT_OK;
	return dsr_forward(skb, p, be->addr[3], (__u16)be->port, 0);
}

/* A client packet of a live DSR flow on the backend node (entry `v` of REPLY key `rk`): a SYN on a
 * closing entry (the pod sent its FIN or RST: ct_touch) opens a new connection on the tuple, so the
 * entry goes (-1). 0 otherwise: the packet is the flow's (a SYN on a live entry is a
 * retransmission, or a forgery: ignored either way; the client's FIN or RST changes nothing
 * either, the pod's own closes the entry). */
static __always_inline int dsr_plain(struct pkt *p, struct ct_key *rk, struct ct_val *v)
{
	if (p->t.proto != IPPROTO_TCP || !ct_may_open(p) || !(v->flags & CT_CLOSING))
		return 0;
	ct_delete(rk);
	return -1;
}

/* The backend node's side (usp_tc_ingress's hook, before nodeport_new), for a packet from a client
 * to a pod here: a packet of a DSR flow this node knows keeps its entry alive and may confirm it
 * (or end it: dsr_plain); a packet that opens a flow and carries an option that can be genuine
 * records the flow's REPLY entry. -1 when neither applies (the caller goes on). */
static __always_inline int dsr_recv(struct __sk_buff *skb, struct pkt *p, __u64 now)
{
	struct ct_key rk = { .saddr = p->t.daddr, .daddr = p->t.saddr, .sport = p->t.dport,
			     .dport = p->t.sport, .proto = p->t.proto, .dir = CT_REPLY };
	struct ct_new_val rv = { .v = { .nat_daddr = p->t.saddr, .nat_dport = p->t.sport, .flags = CT_DSR,
					.created = now, .last = now } };
	struct ct_new_val *pending;
	struct dsr_opt opt = {};
	struct svc_val *svc;
	struct ct_val *v;

	v = ct_find(&rk, now, &pending);
	if (v && !(v->flags & CT_DSR))
		return -1;	/* another kind of flow's reply entry: not DSR's to touch */
	if (v && dsr_plain(p, &rk, v) == 0) {
		v->last = now;
		if (pending)
			ct_try_confirm(p, &rk, NULL);
		return TC_ACT_OK;
	}
	svc = dsr_opt_frontend(skb, p, &opt);
	if (!svc)
		return -1;
	if (!ct_may_open(p))
		return TC_ACT_OK;	/* only a SYN (or a UDP datagram) opens a DSR flow */
	rv.v.nat_saddr = opt.addr;
	rv.v.nat_sport = opt.port;
	rv.v.svc_id = svc->id;
	ct_confirmed_delete(&rk);
	bpf_map_update_elem(&usp_ct_new, &rk, &rv, BPF_ANY);
	return TC_ACT_OK;
}

#endif /* USP_DSR_H */
