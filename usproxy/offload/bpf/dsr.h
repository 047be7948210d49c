/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Direct server return at tc (--bpf-lb-mode dsr) for NodePorts, LoadBalancer IPs and externalIPs,
 * as Cilium's, included by sock_lb.c after its tc section: it uses that section's struct pkt,
 * usp_ct, rewrite() and send().
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
 * bpf_fib_lookup + bpf_redirect_neigh. Only an ORIGINAL usp_ct entry (flag CT_DSR) is written:
 * the reply never comes back through this node. TCP carries the option on SYNs only (a SYN has no
 * payload, so the 8 bytes never push a segment past the MTU); the backend node remembers the flow
 * from it. UDP has no handshake to remember from, so every datagram carries it when it fits: the
 * first packet of a flow that would no longer fit the route's MTU with the 8 bytes is served with
 * SNAT instead (the whole flow), a later datagram that would not fit goes without the option (the
 * backend's node knows the flow from the earlier ones, while its entry lives). Cilium answers
 * ICMP fragmentation-needed there instead.
 *
 * Backend node: a packet carrying the option (first option of the header) naming a frontend this
 * node also serves with F_DSR (an LB IP or externalIP entry of its own for that address and port,
 * else a NodePort for that port) records a REPLY usp_ct entry (backend:port -> client) that names
 * the service address; the existing reverse NAT (reply_nat) then rewrites the reply's source to
 * it where the reply first meets a hooked interface (the pod bridge's ingress) and sends it
 * straight to the client. An option naming a frontend this node does not serve in DSR mode is
 * ignored: nobody can make a pod answer as an arbitrary address.
 *
 * A REPLY entry rewrites only the connection that wrote it. It outlives its connection
 * (CT_LIFETIME_CLOSING past the last FIN or RST, the NONTCP lifetime for UDP), and its key is the
 * whole tuple (pod address and port, client address and port, protocol), which a later connection
 * from the same client port to the same pod reuses: dialled straight to the pod, or DNATed
 * without SNAT by another node. So, on the backend node, a TCP SYN without the option (a new
 * connection that is not DSR) deletes the DSR entry of its tuple, as Cilium's
 * nodeport_extract_dsr_v4 clears the entry's DSR flag on a SYN without DSR info, and a SYN with
 * it rewrites the entry (dsr_recv); a FIN or RST from the client marks the entry closing as the
 * pod's own do in reply_nat, so it ends CT_LIFETIME_CLOSING after the close of either side. A
 * UDP datagram without the option leaves the entry alone, as Cilium's does (it only acts on
 * SYNs): UDP has no handshake telling a new flow from the datagrams of a DSR flow sent without
 * the option because they would not fit with it.
 */
#ifndef USP_DSR_H
#define USP_DSR_H

#define F_DSR		(1U << 12)	/* NodePort in --bpf-lb-mode dsr */
#define CT_DSR		(1U << 1)	/* usp_ct flag: a DSR flow (no SNAT, reply not through here) */

#define DSR_OPT_TYPE	(0x80 | 0x1a)	/* copied on fragmentation, control class, number 26 */
#define DSR_OPT_LEN	8
#define IP_HLEN_BASE	20
#define TCP_SYN		0x02
#define TCP_ACK		0x10

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

/* The DSR frontend an option names, as this node serves it: the LB IP or externalIP entry for
 * (addr, port), else the NodePort `port`; NULL when neither is flagged F_DSR here. */
static __always_inline struct svc_val *dsr_frontend(__u32 addr, __u16 port, __u8 proto)
{
	struct svc_key key = {};
	struct svc_val *svc;

	key_from_v4(&key, addr, port, proto);
	svc = bpf_map_lookup_elem(&usp_services, &key);
	if (svc && (svc->flags & F_TC_ONLY) && (svc->flags & F_DSR))
		return svc;
	key_from_v4(&key, 0, port, proto);
	svc = bpf_map_lookup_elem(&usp_services, &key);
	return svc && (svc->flags & F_DSR) ? svc : NULL;
}

/* A new flow to a DSR frontend (nodeport_new's hook): -1 when DSR does not apply (the backend is
 * on this node, the packet already has IP options or would not fit with the option) and the SNAT
 * path goes on. */
static __always_inline int dsr_new(struct __sk_buff *skb, struct pkt *p, struct svc_val *svc,
				   __u32 be_id, struct backend_val *be, __u64 now)
{
	struct ct_val fv = { .nat_daddr = be->addr[3], .nat_dport = (__u16)be->port,
			     .svc_id = svc->id, .backend_id = be_id, .flags = CT_DSR,
			     .created = now, .last = now, .packets = 1 };
	int via_gw = 0;

	if (!(svc->flags & F_DSR) || (svc->flags & F_LOCAL_ONLY) || p->l4_off != IP_OFF + IP_HLEN_BASE)
		return -1;
	if (!dsr_opt_fits(skb, p, be->addr[3], &via_gw) || !via_gw)
		return -1;
	__sync_fetch_and_add(&be->selected, 1);
	if (bpf_map_update_elem(&usp_ct, &p->t, &fv, BPF_ANY) < 0)
		return TC_ACT_SHOT;
	return dsr_forward(skb, p, be->addr[3], (__u16)be->port, dsr_wants_opt(p));
}

/* A packet of a known DSR flow (nodeport_known's hook, entry `v` already checked): DNAT, and the
 * option again on a retransmitted SYN and on every UDP datagram that fits with it. -1 for a flow
 * that is not DSR. */
static __always_inline int dsr_known(struct __sk_buff *skb, struct pkt *p, struct ct_val *v)
{
	int opt = dsr_wants_opt(p), via_gw = 0;

	if (!(v->flags & CT_DSR))
		return -1;
	if (opt && p->l4_off != IP_OFF + IP_HLEN_BASE)
		return TC_ACT_SHOT;
	if (opt && !dsr_opt_fits(skb, p, v->nat_daddr, &via_gw))
		opt = 0;
	return dsr_forward(skb, p, v->nat_daddr, v->nat_dport, opt);
}

/* The DSR frontend the packet's option (first of its header) names, as this node serves it, with
 * the option in `opt`; NULL when the packet carries no option of ours. */
static __always_inline struct svc_val *dsr_opt_frontend(struct __sk_buff *skb, struct pkt *p,
							 struct dsr_opt *opt)
{
	if (p->l4_off < IP_OFF + IP_HLEN_BASE + DSR_OPT_LEN)
		return NULL;
	if (bpf_skb_load_bytes(skb, IP_OFF + IP_HLEN_BASE, opt, sizeof(*opt)) < 0)
		return NULL;
	if (opt->type != DSR_OPT_TYPE || opt->len != DSR_OPT_LEN)
		return NULL;
	return dsr_frontend(opt->addr, opt->port, p->t.proto);
}

/* A client packet without our option on the backend node, `rk` the REPLY key of its tuple: a SYN
 * opens a connection that is not DSR, so a DSR entry of the tuple is an earlier connection's and
 * goes; a FIN or RST marks it closing. UDP: kept (see the top of this file). */
static __always_inline void dsr_plain(struct pkt *p, struct ct_key *rk)
{
	struct ct_val *v;

	if (!(p->tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST)))
		return;		/* UDP has no flags (parse leaves 0); most TCP packets none of these */
	v = bpf_map_lookup_elem(&usp_ct, rk);
	if (!v || !(v->flags & CT_DSR))
		return;
	if (p->tcp_flags & TCP_SYN) {
		if (!(p->tcp_flags & TCP_ACK))	/* a SYN-ACK is no client's */
			bpf_map_delete_elem(&usp_ct, rk);
		return;
	}
	v->flags |= CT_CLOSING;
}

/* The backend node's side (usp_tc_ingress's hook, before nodeport_new): record the service
 * address a packet carries, or forget a stale entry (dsr_plain). -1 when the packet carries no
 * option of ours (the caller goes on). */
static __always_inline int dsr_recv(struct __sk_buff *skb, struct pkt *p, __u64 now)
{
	struct ct_key rk = { .saddr = p->t.daddr, .daddr = p->t.saddr, .sport = p->t.dport,
			     .dport = p->t.sport, .proto = p->t.proto, .dir = CT_REPLY };
	struct ct_val rv = { .nat_daddr = p->t.saddr, .nat_dport = p->t.sport, .flags = CT_DSR,
			     .created = now, .last = now };
	struct dsr_opt opt = {};
	struct svc_val *svc;

	svc = dsr_opt_frontend(skb, p, &opt);
	if (!svc) {
		dsr_plain(p, &rk);
		return -1;
	}
	rv.nat_saddr = opt.addr;
	rv.nat_sport = opt.port;
	rv.svc_id = svc->id;
	bpf_map_update_elem(&usp_ct, &rk, &rv, BPF_ANY);
	return TC_ACT_OK;
}

#endif /* USP_DSR_H */
