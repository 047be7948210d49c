/* SPDX-License-Identifier: GPL-2.0 */
/*
 * ICMP errors about the tc programs' flows (issue 29 item 3), included by sock_lb.c after its tc
 * section: it uses struct pkt, the conntrack tables (ct_find) and send().
 *
 * A router that cannot pass a packet of a NATed flow answers the packet's source: a reply the tc
 * program reverse-NATed left with the frontend (node address and NodePort, LB IP, externalIP) as
 * its source, so "fragmentation needed" from a smaller hop towards the client comes back to the
 * frontend, where no socket has the connection; the pod that sent the big segments must get it, or
 * path MTU discovery never finishes and a download stalls. As conntrack relates such an error to
 * its flow and NATs it (nf_nat_icmp_reply_translation), icmp_error() does for destination
 * unreachable (every code: fragmentation needed, port unreachable, ...), time exceeded and
 * parameter problem, when the packet the error quotes (the inner header: IP header and the first
 * 8 bytes of TCP or UDP, ports included) belongs to a flow of the tables:
 *   - the quoted packet is a reply as this node sent it to the client (frontend -> client: the
 *     flow's ORIGINAL key, reversed): the error goes to the backend, the quoted packet turned back
 *     into what the backend sent (backend -> SNAT address, or -> client without SNAT), the outer
 *     destination the backend and, for a SNATed flow, the outer source the SNAT address (the pod
 *     knows no other; without SNAT the router's address stays). At ingress only. A DSR flow's
 *     reply left the backend's node with the frontend as its source too, so the error reaches the
 *     ingress node and goes to the backend the same way (its node forwards it to the pod);
 *   - the quoted packet is one this node sent to the backend (SNAT address or client -> backend:
 *     the flow's REPLY key, reversed; port unreachable from a pod whose UDP port is closed): the
 *     error goes to the client, the quoted packet turned back into what the client sent (client
 *     -> frontend), the outer source the frontend, the outer destination the client; at ingress
 *     and at egress (a local backend answering through the node's routing).
 * Every rewritten field is covered: the outer IP checksum, the inner IP checksum, the inner L4
 * checksum when the quote holds it (UDP always: it is within the 8 bytes), and the ICMP checksum
 * for every byte of its payload that changed. The quoted sequence number is left as it is: the
 * pod's TCP checks it against what it sent (a forged error without it is dropped there). An error
 * about no known flow, about a later fragment or an ICMP message, or one the packet truncates
 * before the ports, passes to the stack unchanged.
 */
#ifndef USP_ICMP_ERROR_H
#define USP_ICMP_ERROR_H

#define ICMP_UNREACH_		3
#define ICMP_TIME_EXCEEDED_	11
#define ICMP_PARAMETERPROB_	12
#define ICMP_HLEN		8
#define ICMP_CSUM		2

/* Store a 32-bit word of the ICMP payload and update the ICMP checksum for it. */
static __always_inline int icmp_store32(struct __sk_buff *skb, __u32 csum_off, __u32 off, __u32 old, __u32 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, csum_off, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline int icmp_store16(struct __sk_buff *skb, __u32 csum_off, __u32 off, __u16 old, __u16 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, csum_off, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline int outer_addr(struct __sk_buff *skb, __u32 off, __u32 old, __u32 new)
{
	if (old == new)
		return 0;
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

/* The quoted packet (inner header), as it was and as it must become. */
struct icmp_quote {
	__u32 off;			/* the inner IP header */
	__u32 l4;			/* its L4 header */
	__u8 proto;
	__u16 check;			/* inner IP header checksum */
	__u32 saddr, daddr;
	__u16 sport, dport;
};

/* Rewrite the quote to (saddr:sport -> daddr:dport) with every checksum it touches. */
static __always_inline int icmp_requote(struct __sk_buff *skb, __u32 csum_off, struct icmp_quote *q,
					__u32 saddr, __u16 sport, __u32 daddr, __u16 dport)
{
	__u32 l4_check = q->l4 + (q->proto == IPPROTO_TCP ? TCP_CSUM_OFF : UDP_CSUM_OFF);
	__u16 check = csum_add32(csum_add32(q->check, q->saddr, saddr), q->daddr, daddr);
	__u16 old = 0, new;

	if (icmp_store32(skb, csum_off, q->off + 12, q->saddr, saddr) < 0 ||
	    icmp_store32(skb, csum_off, q->off + 16, q->daddr, daddr) < 0 ||
	    icmp_store16(skb, csum_off, q->off + 10, q->check, check) < 0 ||
	    icmp_store16(skb, csum_off, q->l4, q->sport, sport) < 0 ||
	    icmp_store16(skb, csum_off, q->l4 + 2, q->dport, dport) < 0)
		return -1;
	if (l4_check + 2 > skb->len || bpf_skb_load_bytes(skb, l4_check, &old, sizeof(old)) < 0)
		return 0;	/* the quote ends before the TCP checksum: nothing to update */
	if (q->proto == IPPROTO_UDP && !old)
		return 0;	/* UDP without a checksum */
	new = csum_add32(csum_add32(old, q->saddr, saddr), q->daddr, daddr);
	new = csum_add16(csum_add16(new, q->sport, sport), q->dport, dport);
	if (q->proto == IPPROTO_UDP && !new)
		new = 0xffff;
	return icmp_store16(skb, csum_off, l4_check, old, new);
}

/* The quote of an ICMP error at p->l4_off: 0, or -1 when this is none the tc programs relate. */
static __always_inline int icmp_quote(struct __sk_buff *skb, struct pkt *p, struct icmp_quote *q)
{
	struct iphdr in;
	__u16 ports[2];
	__u8 type;

	if (bpf_skb_load_bytes(skb, p->l4_off, &type, 1) < 0)
		return -1;
	if (type != ICMP_UNREACH_ && type != ICMP_TIME_EXCEEDED_ && type != ICMP_PARAMETERPROB_)
		return -1;
	q->off = p->l4_off + ICMP_HLEN;
	if (bpf_skb_load_bytes(skb, q->off, &in, sizeof(in)) < 0 || in.version != 4 || in.ihl < 5)
		return -1;
	if ((in.protocol != IPPROTO_TCP && in.protocol != IPPROTO_UDP) || (in.frag_off & bpf_htons(IP_OFFSET)))
		return -1;
	q->l4 = q->off + in.ihl * 4;
	if (bpf_skb_load_bytes(skb, q->l4, ports, sizeof(ports)) < 0)
		return -1;
	q->proto = in.protocol;
	q->check = in.check;
	q->saddr = in.saddr;
	q->daddr = in.daddr;
	q->sport = ports[0];
	q->dport = ports[1];
	return 0;
}

/* An ICMP message at tc (usp_tc_ingress, usp_tc_egress: `ingress`): see the top of this file. */
static __always_inline int icmp_error(struct __sk_buff *skb, struct pkt *p, __u64 now, int ingress)
{
	__u32 csum_off = p->l4_off + ICMP_CSUM, outer_src, outer_dst, src, dst;
	struct icmp_quote q = {};
	struct ct_new_val *pending;
	struct ct_key k = {};
	struct ct_val *v;
	__u16 sport, dport;

	if (icmp_quote(skb, p, &q) < 0 ||
	    bpf_skb_load_bytes(skb, IP_SRC_OFF, &outer_src, 4) < 0 || bpf_skb_load_bytes(skb, IP_DST_OFF, &outer_dst, 4) < 0)
		return TC_ACT_OK;
	k.saddr = q.daddr;	/* the quoted packet, seen the other way round */
	k.daddr = q.saddr;
	k.sport = q.dport;
	k.dport = q.sport;
	k.proto = q.proto;
	k.dir = CT_ORIGINAL;
	v = ingress ? ct_find(&k, now, &pending) : NULL;
	if (v) {	/* a reply we sent to the client: towards the backend */
		src = v->nat_daddr;
		sport = v->nat_dport;
		dst = v->nat_saddr ? v->nat_saddr : q.daddr;
		dport = v->nat_saddr ? v->nat_sport : q.dport;
		if (icmp_requote(skb, csum_off, &q, src, sport, dst, dport) < 0 ||
		    outer_addr(skb, IP_DST_OFF, outer_dst, src) < 0 ||
		    outer_addr(skb, IP_SRC_OFF, outer_src, v->nat_saddr ? v->nat_saddr : outer_src) < 0)
			return TC_ACT_SHOT;
		return send(skb, v->nat_saddr ? v->nat_saddr : outer_src, src);
	}
	k.dir = CT_REPLY;
	v = ct_find(&k, now, &pending);
	if (!v)
		return TC_ACT_OK;
	/* a packet we sent to the backend: towards the client, as the client's own packet */
	src = v->nat_daddr;
	sport = v->nat_dport;
	dst = v->nat_saddr;
	dport = v->nat_sport;
	if (icmp_requote(skb, csum_off, &q, src, sport, dst, dport) < 0 ||
	    outer_addr(skb, IP_DST_OFF, outer_dst, src) < 0 || outer_addr(skb, IP_SRC_OFF, outer_src, dst) < 0)
		return TC_ACT_SHOT;
	return ingress ? send(skb, dst, src) : TC_ACT_OK;
}

#endif /* USP_ICMP_ERROR_H */
