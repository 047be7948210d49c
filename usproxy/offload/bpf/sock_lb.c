// SPDX-License-Identifier: GPL-2.0
/*
 * usproxy socket load balancer: Service translation at connect() and sendmsg(), reverse
 * translation at recvmsg() and getpeername(), for processes in one cgroup v2 subtree.
 *
 * The behaviour follows Cilium's socket LB (bpf/bpf_sock.c, bpf/lib/lb.h); the code is usproxy's.
 * Layout is mirrored in usproxy/offload/bpf/layout.py: change both together and bump
 * LAYOUT_VERSION there (pinned maps of another layout are never reused).
 *
 * Addresses are 16 bytes in network order; IPv4 is held as v4-mapped IPv6 (::ffff:a.b.c.d), so
 * one services map serves connect4, connect6 and v4-mapped addresses on IPv6 sockets alike.
 * Ports are in network order in the low 16 bits, as in struct bpf_sock_addr.
 *
 * The tc programs at the end (usp_tc_ingress, usp_tc_egress) serve NodePorts, LoadBalancer IPs
 * and externalIPs for packets from outside the node; their own section below says how.
 *
 * Build: clang -target bpf -O2 -g -mcpu=v3 -I/usr/include/x86_64-linux-gnu -c sock_lb.c
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define SYS_REJECT	0
#define SYS_PROCEED	1
#define ECONNREFUSED	111

#define F_AFFINITY	(1U << 0)	/* sessionAffinity: ClientIP (per client netns, as Cilium) */
#define F_MAGLEV	(1U << 1)	/* select through the Maglev table, not the slots */
#define F_ROUND_ROBIN	(1U << 2)	/* TCP connect: a shared counter instead of a random draw */
#define F_LOCAL_ONLY	(1U << 3)	/* NodePort with externalTrafficPolicy Local: never SNAT */
#define F_TC_ONLY	(1U << 8)	/* a frontend for the tc programs only (tc_frontends.h) */

#define MAGLEV_M	16381		/* Maglev table size (prime), Cilium's default */

#define NOT_A_SERVICE	1

struct svc_key {
	__u32 addr[4];
	__u32 port;			/* network order, low 16 bits */
	__u32 proto;			/* IPPROTO_TCP or IPPROTO_UDP */
};

struct svc_val {
	__u32 count;			/* usable endpoints; 0 refuses at once */
	__u32 id;			/* service id: slots, backends, affinity and names use it */
	__u32 affinity_timeout;		/* seconds */
	__u32 flags;
	__u32 rr;			/* round-robin counter (kernel writes it) */
	__u32 pad;
};

struct slot_key {
	__u32 svc_id;
	__u32 slot;			/* 1 .. count */
};

struct backend_val {
	__u32 addr[4];
	__u32 port;			/* network order, low 16 bits */
	__u32 svc_id;			/* the service this backend id belongs to */
	__u64 selected;			/* times chosen (kernel writes it) */
};

struct affinity_key {
	__u64 client;			/* netns cookie of the connecting process */
	__u32 svc_id;
	__u32 pad;
};

struct affinity_val {
	__u64 last_used;		/* CLOCK_MONOTONIC ns */
	__u32 backend_id;
	__u32 pad;
};

struct revnat_key {
	__u64 cookie;			/* socket cookie */
	__u32 addr[4];			/* backend */
	__u32 port;
	__u32 pad;
};

struct revnat_val {
	__u32 addr[4];			/* service frontend */
	__u32 port;
	__u32 svc_id;
};

struct flow_val {
	__u64 created;			/* CLOCK_MONOTONIC ns */
	__u64 last;
	__u64 netns;
	__u64 packets;			/* connects + unconnected sends */
	__u32 svc_id;
	__u32 backend_id;
	__u32 proto;
	__u32 svc_port;
	__u32 svc_addr[4];
	__u32 be_addr[4];
	__u32 be_port;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct svc_key);
	__type(value, struct svc_val);
} usp_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);	/* --bpf-lb-map-max: map_sizes.py */
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct slot_key);
	__type(value, __u32);
} usp_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);	/* --bpf-lb-map-max: map_sizes.py */
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct backend_val);
} usp_backends SEC(".maps");

/* The backend id of (service id, address, port): whether a packet's destination is a backend of a
 * Service (dsr.h: a DSR option is accepted only for one). Written with usp_backends. */
struct backend_key {
	__u32 svc_id;
	__u32 port;			/* network order, low 16 bits */
	__u32 addr[4];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);	/* --bpf-lb-map-max: map_sizes.py */
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct backend_key);
	__type(value, __u32);
} usp_backend_ids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct affinity_key);
	__type(value, struct affinity_val);
} usp_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct revnat_key);
	__type(value, struct revnat_val);
} usp_revnat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, __u64);
	__type(value, struct flow_val);
} usp_flows SEC(".maps");

/* Not read by the programs: lets a restarted agent name what it finds (read-back). */
struct name_val {
	char text[256];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct name_val);
} usp_names SEC(".maps");

struct maglev_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAGLEV_M);
	__type(key, __u32);
	__type(value, __u32);
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__array(values, struct maglev_inner);
} usp_maglev SEC(".maps");

/* A fixed mixer (splitmix64's finaliser): socket cookies are sequential, selection must not be. */
static __always_inline __u64 mix64(__u64 x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ULL;
	x ^= x >> 33;
	return x;
}

static __always_inline void key_from_v4(struct svc_key *key, __u32 ip4, __u32 port, __u32 proto)
{
	key->addr[0] = 0;
	key->addr[1] = 0;
	key->addr[2] = bpf_htonl(0x0000ffff);
	key->addr[3] = ip4;
	key->port = port & 0xffff;
	key->proto = proto;
}

static __always_inline void key_from_v6(struct svc_key *key, struct bpf_sock_addr *ctx)
{
	key->addr[0] = ctx->user_ip6[0];
	key->addr[1] = ctx->user_ip6[1];
	key->addr[2] = ctx->user_ip6[2];
	key->addr[3] = ctx->user_ip6[3];
	key->port = ctx->user_port & 0xffff;
	key->proto = ctx->protocol;
}

static __always_inline int proto_handled(__u32 proto)
{
	return proto == IPPROTO_TCP || proto == IPPROTO_UDP;
}

/* Affinity as Cilium's lb4_affinity_backend_id_by_netns: expired entries are deleted, a hit
 * refreshes last_used, so the timeout counts from the last new connection. */
static __always_inline __u32 affinity_get(struct svc_val *svc, __u64 client, __u64 now)
{
	struct affinity_key k = { .client = client, .svc_id = svc->id };
	struct affinity_val *v = bpf_map_lookup_elem(&usp_affinity, &k);

	if (!v)
		return 0;
	if (v->last_used + (__u64)svc->affinity_timeout * 1000000000ULL <= now) {
		bpf_map_delete_elem(&usp_affinity, &k);
		return 0;
	}
	v->last_used = now;
	return v->backend_id;
}

static __always_inline void affinity_put(struct svc_val *svc, __u64 client, __u64 now, __u32 id)
{
	struct affinity_key k = { .client = client, .svc_id = svc->id };
	struct affinity_val v = { .last_used = now, .backend_id = id };

	bpf_map_update_elem(&usp_affinity, &k, &v, BPF_ANY);
}

static __always_inline __u32 pick_maglev(struct svc_val *svc, __u64 h)
{
	void *table = bpf_map_lookup_elem(&usp_maglev, &svc->id);
	__u32 idx = h % MAGLEV_M;
	__u32 *id;

	if (!table)
		return 0;
	id = bpf_map_lookup_elem(table, &idx);
	return id ? *id : 0;
}

/* Slot selection as Cilium's socket LB: a random draw for TCP, the socket cookie for UDP (a
 * datagram socket keeps its endpoint across unconnected sends), modulo the endpoint count. */
static __always_inline __u32 pick(struct bpf_sock_addr *ctx, struct svc_val *svc)
{
	struct slot_key sk = { .svc_id = svc->id };
	__u32 *id, count = svc->count;
	__u64 h;

	if (ctx->protocol == IPPROTO_UDP)
		h = mix64(bpf_get_socket_cookie(ctx));
	else if (svc->flags & F_ROUND_ROBIN)
		h = __sync_fetch_and_add(&svc->rr, 1);
	else
		h = bpf_get_prandom_u32();
	if (svc->flags & F_MAGLEV) {
		__u32 mid = pick_maglev(svc, h);

		if (mid)
			return mid;
	}
	if (!count)
		return 0;
	sk.slot = (__u32)(h % count) + 1;
	id = bpf_map_lookup_elem(&usp_slots, &sk);
	return id ? *id : 0;
}

static __always_inline struct backend_val *backend_of(struct svc_val *svc, __u32 id)
{
	struct backend_val *be;

	if (!id)
		return NULL;
	be = bpf_map_lookup_elem(&usp_backends, &id);
	if (!be || be->svc_id != svc->id)
		return NULL;
	return be;
}

static __always_inline int same_revnat(const struct revnat_val *a, const struct revnat_val *b)
{
	return a->addr[0] == b->addr[0] && a->addr[1] == b->addr[1] && a->addr[2] == b->addr[2] &&
	       a->addr[3] == b->addr[3] && a->port == b->port && a->svc_id == b->svc_id;
}

/* Remember the translation for this socket: the reverse entry (recvmsg, getpeername) and the
 * flow row. Written only when it changed, so a busy unconnected UDP socket costs no update. */
static __always_inline void remember(struct bpf_sock_addr *ctx, const struct svc_key *key,
				     struct svc_val *svc, struct backend_val *be, __u32 be_id,
				     __u64 now, __u64 netns)
{
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct revnat_key rk = { .cookie = cookie, .port = be->port };
	struct revnat_val rv = { .port = key->port, .svc_id = svc->id };
	struct revnat_val *old;
	struct flow_val *f;
	struct flow_val nf = {};

	__builtin_memcpy(rk.addr, be->addr, sizeof(rk.addr));
	__builtin_memcpy(rv.addr, key->addr, sizeof(rv.addr));
	old = bpf_map_lookup_elem(&usp_revnat, &rk);
	if (!old || !same_revnat(old, &rv))
		bpf_map_update_elem(&usp_revnat, &rk, &rv, BPF_ANY);

	f = bpf_map_lookup_elem(&usp_flows, &cookie);
	if (f && f->svc_id == svc->id && f->backend_id == be_id) {
		f->last = now;
		__sync_fetch_and_add(&f->packets, 1);
		return;
	}
	nf.created = now;
	nf.last = now;
	nf.netns = netns;
	nf.packets = 1;
	nf.svc_id = svc->id;
	nf.backend_id = be_id;
	nf.proto = key->proto;
	nf.svc_port = key->port;
	nf.be_port = be->port;
	__builtin_memcpy(nf.svc_addr, key->addr, sizeof(nf.svc_addr));
	__builtin_memcpy(nf.be_addr, be->addr, sizeof(nf.be_addr));
	bpf_map_update_elem(&usp_flows, &cookie, &nf, BPF_ANY);
}

/*
 * Translate `key` (the destination the application asked for) to an endpoint, as Cilium's
 * __sock4_xlate_fwd: 0 and `*out` set when translated, NOT_A_SERVICE when the address is no
 * Service (or no slot answered: the connect proceeds untouched, as Cilium does), -ECONNREFUSED
 * when the Service has no usable endpoint.
 */
static __always_inline int xlate_fwd(struct bpf_sock_addr *ctx, const struct svc_key *key,
				     struct backend_val **out)
{
	struct svc_val *svc = bpf_map_lookup_elem(&usp_services, key);
	struct backend_val *be = NULL;
	__u64 now, netns = 0;
	__u32 id = 0;

	if (!svc || (svc->flags & F_TC_ONLY))
		return NOT_A_SERVICE;
	if (!svc->count)
		return -ECONNREFUSED;
	now = bpf_ktime_get_ns();
	netns = bpf_get_netns_cookie(ctx);
	if (svc->flags & F_AFFINITY) {
		id = affinity_get(svc, netns, now);
		be = backend_of(svc, id);
	}
	if (!be) {
		id = pick(ctx, svc);
		be = backend_of(svc, id);
		if (!be)
			return NOT_A_SERVICE;
		if (svc->flags & F_AFFINITY)
			affinity_put(svc, netns, now, id);
	}
	__sync_fetch_and_add(&be->selected, 1);
	remember(ctx, key, svc, be, id, now, netns);
	*out = be;
	return 0;
}

/* Reverse translation (Cilium's __sock4_xlate_rev): the endpoint's address becomes the
 * Service's again, unless the Service is gone or was replaced (then the entry is dropped). */
static __always_inline int xlate_rev(struct bpf_sock_addr *ctx, const struct svc_key *seen,
				     struct revnat_val **out)
{
	struct revnat_key rk = { .cookie = bpf_get_socket_cookie(ctx), .port = seen->port };
	struct svc_key sk = { .port = 0 };
	struct revnat_val *rv;
	struct svc_val *svc;

	__builtin_memcpy(rk.addr, seen->addr, sizeof(rk.addr));
	rv = bpf_map_lookup_elem(&usp_revnat, &rk);
	if (!rv)
		return NOT_A_SERVICE;
	__builtin_memcpy(sk.addr, rv->addr, sizeof(sk.addr));
	sk.port = rv->port;
	sk.proto = seen->proto;
	svc = bpf_map_lookup_elem(&usp_services, &sk);
	if (!svc || svc->id != rv->svc_id) {
		bpf_map_delete_elem(&usp_revnat, &rk);
		return NOT_A_SERVICE;
	}
	*out = rv;
	return 0;
}

static __always_inline int is_v4_mapped(const __u32 *addr)
{
	return addr[0] == 0 && addr[1] == 0 && addr[2] == bpf_htonl(0x0000ffff);
}

static __always_inline int fwd4(struct bpf_sock_addr *ctx)
{
	struct backend_val *be = NULL;
	struct svc_key key = {};
	int ret;

	if (!proto_handled(ctx->protocol))
		return SYS_PROCEED;
	key_from_v4(&key, ctx->user_ip4, ctx->user_port, ctx->protocol);
	ret = xlate_fwd(ctx, &key, &be);
	if (ret < 0) {
		bpf_set_retval(ret);
		return SYS_REJECT;
	}
	if (ret == 0 && be && is_v4_mapped(be->addr)) {
		ctx->user_ip4 = be->addr[3];
		ctx->user_port = be->port;
	}
	return SYS_PROCEED;
}

static __always_inline int fwd6(struct bpf_sock_addr *ctx)
{
	struct backend_val *be = NULL;
	struct svc_key key = {};
	int ret;

	if (!proto_handled(ctx->protocol))
		return SYS_PROCEED;
	key_from_v6(&key, ctx);
	ret = xlate_fwd(ctx, &key, &be);
	if (ret < 0) {
		bpf_set_retval(ret);
		return SYS_REJECT;
	}
	if (ret == 0 && be) {
		ctx->user_ip6[0] = be->addr[0];
		ctx->user_ip6[1] = be->addr[1];
		ctx->user_ip6[2] = be->addr[2];
		ctx->user_ip6[3] = be->addr[3];
		ctx->user_port = be->port;
	}
	return SYS_PROCEED;
}

static __always_inline int rev4(struct bpf_sock_addr *ctx)
{
	struct revnat_val *rv = NULL;
	struct svc_key seen = {};

	if (!proto_handled(ctx->protocol))
		return SYS_PROCEED;
	key_from_v4(&seen, ctx->user_ip4, ctx->user_port, ctx->protocol);
	if (xlate_rev(ctx, &seen, &rv) == 0 && rv) {
		ctx->user_ip4 = rv->addr[3];
		ctx->user_port = rv->port;
	}
	return SYS_PROCEED;
}

static __always_inline int rev6(struct bpf_sock_addr *ctx)
{
	struct revnat_val *rv = NULL;
	struct svc_key seen = {};

	if (!proto_handled(ctx->protocol))
		return SYS_PROCEED;
	key_from_v6(&seen, ctx);
	if (xlate_rev(ctx, &seen, &rv) == 0 && rv) {
		ctx->user_ip6[0] = rv->addr[0];
		ctx->user_ip6[1] = rv->addr[1];
		ctx->user_ip6[2] = rv->addr[2];
		ctx->user_ip6[3] = rv->addr[3];
		ctx->user_port = rv->port;
	}
	return SYS_PROCEED;
}

SEC("cgroup/connect4")
int usp_connect4(struct bpf_sock_addr *ctx)
{
	return fwd4(ctx);
}

SEC("cgroup/connect6")
int usp_connect6(struct bpf_sock_addr *ctx)
{
	return fwd6(ctx);
}

SEC("cgroup/sendmsg4")
int usp_sendmsg4(struct bpf_sock_addr *ctx)
{
	return fwd4(ctx);
}

SEC("cgroup/sendmsg6")
int usp_sendmsg6(struct bpf_sock_addr *ctx)
{
	return fwd6(ctx);
}

SEC("cgroup/recvmsg4")
int usp_recvmsg4(struct bpf_sock_addr *ctx)
{
	return rev4(ctx);
}

SEC("cgroup/recvmsg6")
int usp_recvmsg6(struct bpf_sock_addr *ctx)
{
	return rev6(ctx);
}

SEC("cgroup/getpeername4")
int usp_getpeername4(struct bpf_sock_addr *ctx)
{
	return rev4(ctx);
}

SEC("cgroup/getpeername6")
int usp_getpeername6(struct bpf_sock_addr *ctx)
{
	return rev6(ctx);
}

/* A socket that goes away takes its flow row and its reverse entry with it. */
SEC("cgroup/sock_release")
int usp_sock_release(struct bpf_sock *sk)
{
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct flow_val *f = bpf_map_lookup_elem(&usp_flows, &cookie);
	struct revnat_key rk = { .cookie = cookie };

	if (!f)
		return SYS_PROCEED;
	__builtin_memcpy(rk.addr, f->be_addr, sizeof(rk.addr));
	rk.port = f->be_port;
	bpf_map_delete_elem(&usp_revnat, &rk);
	bpf_map_delete_elem(&usp_flows, &cookie);
	return SYS_PROCEED;
}

/*
 * NodePort at tc, for packets from outside the node (the shape of Cilium's bpf_host.c with
 * lib/nodeport.h nodeport_lb4 and its SNAT; the code is usproxy's). IPv4, TCP and UDP only.
 *
 * A NodePort is a usp_services entry whose address is ::ffff:0.0.0.0 (any node address); the
 * addresses that serve NodePorts (--nodeport-addresses) are in usp_tc_addrs, and usp_tc_ifaces
 * maps every hooked interface to its address (the SNAT source when a backend is reached through
 * it). usp_tc_ingress, on every hooked interface:
 *   1. a reply of a known flow (REPLY key) gets its source back to node:NodePort and its
 *      destination back to the client, and is redirected towards the client;
 *   2. a packet of a known flow (ORIGINAL key) goes to the backend the flow already has;
 *   3. a new flow to a NodePort picks a backend (random, round robin or Maglev as the socket
 *      LB), is DNATed to it, SNATed to the egress interface's address when that interface is
 *      hooked too (externalTrafficPolicy Cluster: the reply must come back through a hook) and
 *      not with F_LOCAL_ONLY, and both entries are written.
 * Packets leave with bpf_fib_lookup (the egress interface) and bpf_redirect_neigh (the kernel
 * resolves the next hop): a rewritten packet may carry a node address as its source, which the
 * stack's forwarding path would drop as a martian. usp_tc_egress only reverse-NATs replies that
 * leave through a hooked interface without having entered through one (a local backend without
 * SNAT answering the client through the node's routing).
 * LoadBalancer IPs and externalIPs are frontends too, with loadBalancerSourceRanges,
 * sessionAffinity and the no-endpoint verdicts (drop or refuse as kube-proxy): tc_frontends.h.
 *
 * Connection tracking (issue 29), three LRU tables of one key and value shape:
 *   usp_ct_new  flows not confirmed yet: every new flow starts here (both entries);
 *   usp_ct      confirmed TCP flows;   usp_ct_any  confirmed flows of other protocols (UDP);
 * so new flows, which anyone can start with spoofed packets, never evict confirmed ones, and a
 * UDP flood never evicts a TCP flow (Cilium splits its CT maps by protocol the same way). A flow
 * is confirmed, both entries moved, when the client proves it sees the replies: for TCP a reply
 * SYN-ACK passed (its sequence number is kept) and then a client ACK acknowledges it (within
 * CT_ACK_WINDOW): what nf_conntrack calls assured, which a blind spoofer cannot reach; for UDP a
 * reply passed and the client sent again. Only a TCP SYN (no ACK, RST or FIN) or a UDP datagram
 * opens a flow; a TCP segment of a flow no table holds (an entry lost to the LRU) opens none: at
 * a DSR frontend it is forwarded again to the backend the Maglev table names (dsr_stateless: the
 * backend's node still holds the flow), else it passes to the stack, which resets it, as
 * kube-proxy's datapath does with a segment it has no connection for.
 * ICMP errors (destination unreachable, fragmentation needed among them, time exceeded,
 * parameter problem) about a packet of a known flow are reverse-NATed as conntrack does
 * (icmp_error: outer and inner headers, checksums): from the client's side towards the backend,
 * from the backend's side towards the client. Fragments: the first fragment's ports are kept in
 * usp_frags by (source, destination, IP id, protocol), so the later ones, which carry no ports,
 * follow it through the same flow (Cilium's ipv4_handle_fragmentation); a later fragment whose
 * first one was not seen passes to the stack.
 * Everything else passes unchanged (TC_ACT_OK) to the stack: nftables or the relay.
 */

#define CT_ORIGINAL	0
#define CT_REPLY	1
#define CT_CLOSING	(1U << 0)
#define CT_SEEN_REPLY	(1U << 2)	/* usp_ct_new: a reply passed (a SYN-ACK's sequence number in isn) */

#define CT_LIFETIME_TCP		21600ULL	/* s, Cilium's CT_CONNECTION_LIFETIME_TCP */
#define CT_LIFETIME_NONTCP	60ULL		/* s, Cilium's CT_CONNECTION_LIFETIME_NONTCP */
#define CT_LIFETIME_CLOSING	10ULL		/* s, Cilium's CT_CLOSE_TIMEOUT */
#define CT_LIFETIME_SYN		60ULL		/* s, Cilium's CT_SYN_TIMEOUT: a TCP flow not confirmed */
#define CT_ACK_WINDOW		(1U << 20)	/* a confirming ACK acknowledges at most 1 MiB past the SYN-ACK */
#define NSEC			1000000000ULL

#define SNAT_PORT_MIN	32768
#define SNAT_PORT_SPAN	28232		/* 32768 .. 60999, the default ip_local_port_range */
#define SNAT_TRIES	8

#define IP_OFF		ETH_HLEN
#define IP_CSUM_OFF	(ETH_HLEN + 10)
#define IP_SRC_OFF	(ETH_HLEN + 12)
#define IP_DST_OFF	(ETH_HLEN + 16)
#define TCP_FLAGS_OFF	13
#define TCP_CSUM_OFF	16
#define UDP_CSUM_OFF	6
#define TCP_FIN		0x01
#define TCP_SYN		0x02
#define TCP_RST		0x04
#define TCP_ACK		0x10
#define IP_MF		0x2000
#define IP_OFFSET	0x1fff
#define IP_FRAG_MASK	0x3fff
#define AF_INET_	2

#define FRAG_NONE	0
#define FRAG_FIRST	1		/* offset 0, more to come: carries the ports */
#define FRAG_LATER	2		/* offset > 0: no L4 header, ports from usp_frags */

#define PARSE_ICMP	1		/* parse(): an ICMP message (icmp_error's) */

struct ct_key {
	__u32 saddr;			/* network order, as in the packet */
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 dir;			/* CT_ORIGINAL or CT_REPLY */
	__u16 pad;
};

struct ct_val {
	__u32 nat_saddr;		/* ORIGINAL: SNAT address (0: none); REPLY: node address */
	__u32 nat_daddr;		/* ORIGINAL: backend; REPLY: client */
	__u16 nat_sport;		/* ORIGINAL: SNAT port; REPLY: NodePort */
	__u16 nat_dport;		/* ORIGINAL: backend port; REPLY: client port */
	__u32 svc_id;
	__u32 backend_id;
	__u32 flags;			/* CT_CLOSING once the backend sent a FIN or RST, CT_DSR, CT_SEEN_REPLY */
	__u64 created;			/* CLOCK_MONOTONIC ns */
	__u64 last;
	__u64 packets;
};

struct ct_new_val {
	struct ct_val v;
	__u32 isn;			/* REPLY entry with CT_SEEN_REPLY: the SYN-ACK's sequence number */
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct ct_key);
	__type(value, struct ct_val);
} usp_ct SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 131072);
	__type(key, struct ct_key);
	__type(value, struct ct_val);
} usp_ct_any SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 131072);
	__type(key, struct ct_key);
	__type(value, struct ct_new_val);
} usp_ct_new SEC(".maps");

struct frag_key {
	__u32 saddr;
	__u32 daddr;
	__u16 id;
	__u8 proto;
	__u8 pad;
};

struct frag_ports {
	__u16 sport;
	__u16 dport;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);	/* Cilium's CILIUM_IPV4_FRAG_MAP_MAX_ENTRIES */
	__type(key, struct frag_key);
	__type(value, struct frag_ports);
} usp_frags SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);		/* IPv4 address, network order */
	__type(value, __u32);		/* ifindex it belongs to */
} usp_tc_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);		/* ifindex of a hooked interface */
	__type(value, __u32);		/* its IPv4 address (the SNAT source), network order */
} usp_tc_ifaces SEC(".maps");

struct pkt {
	struct ct_key t;		/* the packet's tuple, dir CT_ORIGINAL */
	__u32 l4_off;
	__u32 csum_off;			/* 0: no L4 checksum to update (UDP with checksum 0, a later fragment) */
	__u32 seq;			/* TCP, network order */
	__u32 ack;
	__u8 tcp_flags;
	__u8 frag;			/* FRAG_NONE, FRAG_FIRST or FRAG_LATER */
};

/* RFC 1624 incremental update of a ones' complement sum for a 16-bit word (any byte order, as
 * long as old and new are read the same way as the sum). */
static __always_inline __u16 csum_add16(__u16 sum, __u16 old, __u16 new)
{
	__u32 s = (__u16)~sum + (__u32)(__u16)~old + new;

	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

static __always_inline __u16 csum_add32(__u16 sum, __u32 old, __u32 new)
{
	sum = csum_add16(sum, (__u16)old, (__u16)new);
	return csum_add16(sum, (__u16)(old >> 16), (__u16)(new >> 16));
}

/* The ports of a later fragment: those its first fragment had (usp_frags), or -1. */
static __always_inline int frag_ports(struct iphdr *ip, struct pkt *p)
{
	struct frag_key fk = { .saddr = ip->saddr, .daddr = ip->daddr, .id = ip->id, .proto = ip->protocol };
	struct frag_ports *fp = bpf_map_lookup_elem(&usp_frags, &fk);

	if (!fp)
		return -1;
	p->t.sport = fp->sport;
	p->t.dport = fp->dport;
	p->frag = FRAG_LATER;
	p->csum_off = 0;
	return 0;
}

static __always_inline void frag_remember(struct iphdr *ip, struct pkt *p)
{
	struct frag_key fk = { .saddr = ip->saddr, .daddr = ip->daddr, .id = ip->id, .proto = ip->protocol };
	struct frag_ports fp = { .sport = p->t.sport, .dport = p->t.dport };

	bpf_map_update_elem(&usp_frags, &fk, &fp, BPF_ANY);
	p->frag = FRAG_FIRST;
}

/* 0: a TCP or UDP packet (or fragment) of ours to look at; PARSE_ICMP: an ICMP message; -1: pass. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
	struct iphdr ip;
	__u8 tcp[14];
	__u16 csum = 0;

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return -1;
	if (bpf_skb_load_bytes(skb, IP_OFF, &ip, sizeof(ip)) < 0 || ip.version != 4 || ip.ihl < 5)
		return -1;
	if (ip.tot_len ? bpf_ntohs(ip.tot_len) < ip.ihl * 4 || bpf_ntohs(ip.tot_len) > skb->len - IP_OFF
		       : skb->len <= 0xffff + IP_OFF)	/* 0: a BIG TCP packet past 64 KiB */
		return -1;	/* a truncated packet: the stack drops it */
	p->l4_off = IP_OFF + ip.ihl * 4;
	if (ip.protocol == IPPROTO_ICMP)
		return (ip.frag_off & bpf_htons(IP_FRAG_MASK)) ? -1 : PARSE_ICMP;
	if (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP)
		return -1;
	p->t.saddr = ip.saddr;
	p->t.daddr = ip.daddr;
	p->t.proto = ip.protocol;
	p->t.dir = CT_ORIGINAL;
	if (ip.frag_off & bpf_htons(IP_OFFSET))
		return frag_ports(&ip, p);
	if (ip.tot_len && bpf_ntohs(ip.tot_len) < ip.ihl * 4 + (ip.protocol == IPPROTO_TCP ? 20 : 8))
		return -1;	/* no room for the L4 header the packet claims */
	if (ip.protocol == IPPROTO_TCP) {
		if (bpf_skb_load_bytes(skb, p->l4_off, tcp, sizeof(tcp)) < 0)
			return -1;
		__builtin_memcpy(&p->t.sport, tcp, 2);
		__builtin_memcpy(&p->t.dport, tcp + 2, 2);
		__builtin_memcpy(&p->seq, tcp + 4, 4);
		__builtin_memcpy(&p->ack, tcp + 8, 4);
		p->tcp_flags = tcp[TCP_FLAGS_OFF];
		p->csum_off = p->l4_off + TCP_CSUM_OFF;
	} else {
		__u16 ports[2];

		if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0 ||
		    bpf_skb_load_bytes(skb, p->l4_off + UDP_CSUM_OFF, &csum, sizeof(csum)) < 0)
			return -1;
		p->t.sport = ports[0];
		p->t.dport = ports[1];
		p->csum_off = csum ? p->l4_off + UDP_CSUM_OFF : 0;
	}
	if (ip.frag_off & bpf_htons(IP_MF))
		frag_remember(&ip, p);
	return 0;
}

/* -- connection tracking ------------------------------------------------------------------- */

static __always_inline struct ct_val *ct_confirmed(struct ct_key *k)
{
	if (k->proto == IPPROTO_TCP)
		return bpf_map_lookup_elem(&usp_ct, k);
	return bpf_map_lookup_elem(&usp_ct_any, k);
}

static __always_inline long ct_confirmed_put(struct ct_key *k, struct ct_val *v)
{
	if (k->proto == IPPROTO_TCP)
		return bpf_map_update_elem(&usp_ct, k, v, BPF_ANY);
	return bpf_map_update_elem(&usp_ct_any, k, v, BPF_ANY);
}

static __always_inline void ct_confirmed_delete(struct ct_key *k)
{
	if (k->proto == IPPROTO_TCP)
		bpf_map_delete_elem(&usp_ct, k);
	else
		bpf_map_delete_elem(&usp_ct_any, k);
}

/* An entry of `k` wherever it is (a flow ends, or goes elsewhere). */
static __always_inline void ct_delete(struct ct_key *k)
{
	ct_confirmed_delete(k);
	bpf_map_delete_elem(&usp_ct_new, k);
}

static __always_inline __u64 ct_lifetime(const struct ct_val *v, __u8 proto, int pending)
{
	if (v->flags & CT_CLOSING)
		return CT_LIFETIME_CLOSING * NSEC;
	if (proto != IPPROTO_TCP)
		return CT_LIFETIME_NONTCP * NSEC;
	return (pending ? CT_LIFETIME_SYN : CT_LIFETIME_TCP) * NSEC;
}

/* The live entry for `k`, confirmed or not (then `*pending` points at it), not refreshed; an
 * expired one is deleted (timeouts; the LRU evicts the rest). */
static __always_inline struct ct_val *ct_find(struct ct_key *k, __u64 now, struct ct_new_val **pending)
{
	struct ct_val *v = ct_confirmed(k);
	struct ct_new_val *n;

	*pending = NULL;
	if (v) {
		if (v->last + ct_lifetime(v, k->proto, 0) > now)
			return v;
		ct_confirmed_delete(k);
	}
	n = bpf_map_lookup_elem(&usp_ct_new, k);
	if (!n)
		return NULL;
	if (n->v.last + ct_lifetime(&n->v, k->proto, 1) <= now) {
		bpf_map_delete_elem(&usp_ct_new, k);
		return NULL;
	}
	*pending = n;
	return &n->v;
}

/* A packet of the flow passed its entry `k`: refreshed and counted. A FIN or RST from the
 * backend's side (a REPLY entry) closes the flow: both entries get CT_CLOSING, so they end
 * CT_LIFETIME_CLOSING after their last packet and a SYN may open a new flow on the tuple. The
 * client's side closes nothing: the backend answers a genuine FIN with its own and a genuine RST
 * closes the connection anyway, while anyone who knows a client's tuple can forge one (the tables
 * keep no sequence window to tell; nf_conntrack does), and an idle connection would lose its
 * entries 10 s later. */
static __always_inline void ct_touch(struct ct_key *k, struct ct_val *v, struct pkt *p, __u64 now)
{
	struct ct_new_val *n;
	struct ct_key ok;
	struct ct_val *o;

	v->last = now;
	__sync_fetch_and_add(&v->packets, 1);
	if (k->dir != CT_REPLY || !(p->tcp_flags & (TCP_FIN | TCP_RST)) || (v->flags & CT_CLOSING))
		return;
	v->flags |= CT_CLOSING;
	ok.saddr = v->nat_daddr;
	ok.daddr = v->nat_saddr;
	ok.sport = v->nat_dport;
	ok.dport = v->nat_sport;
	ok.proto = k->proto;
	ok.dir = CT_ORIGINAL;
	ok.pad = 0;
	o = ct_confirmed(&ok);
	if (!o) {
		n = bpf_map_lookup_elem(&usp_ct_new, &ok);
		o = n ? &n->v : NULL;
	}
	if (o)
		o->flags |= CT_CLOSING;
}

/* ct_find, touched. */
static __always_inline struct ct_val *ct_get(struct ct_key *k, struct pkt *p, __u64 now,
					     struct ct_new_val **pending)
{
	struct ct_val *v = ct_find(k, now, pending);

	if (v)
		ct_touch(k, v, p, now);
	return v;
}

/* A reply passed a flow not yet confirmed: remember it (for TCP only a SYN-ACK counts, and its
 * sequence number is what the client's ACK must acknowledge). */
static __always_inline void ct_saw_reply(struct pkt *p, struct ct_new_val *n)
{
	if (n->v.flags & CT_SEEN_REPLY)
		return;
	if (p->t.proto == IPPROTO_TCP) {
		if ((p->tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST)) != (TCP_SYN | TCP_ACK))
			return;
		n->isn = bpf_ntohl(p->seq);
	}
	n->v.flags |= CT_SEEN_REPLY;
}

/* Whether a client packet confirms the flow whose REPLY entry `r` is pending: a reply passed
 * and, for TCP, the packet is an ACK of the SYN-ACK (or of what followed it, within
 * CT_ACK_WINDOW): a host that never saw the SYN-ACK cannot send one. */
static __always_inline int ct_confirms(const struct pkt *p, const struct ct_new_val *r)
{
	if (!(r->v.flags & CT_SEEN_REPLY) || p->frag == FRAG_LATER)
		return 0;
	if (p->t.proto != IPPROTO_TCP)
		return 1;
	if ((p->tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST)) != TCP_ACK)
		return 0;
	return bpf_ntohl(p->ack) - (r->isn + 1) < CT_ACK_WINDOW;
}

static __always_inline int ct_promote(struct ct_key *k, struct ct_new_val *n)
{
	struct ct_val v = n->v;

	v.flags &= ~CT_SEEN_REPLY;
	if (ct_confirmed_put(k, &v) < 0)
		return -1;
	bpf_map_delete_elem(&usp_ct_new, k);
	return 0;
}

/* A client packet of a pending flow: when it confirms the flow (ct_confirms), its REPLY entry
 * `rk` and its ORIGINAL entry `ok` (none on a DSR backend's node) move to the confirmed table; an
 * ORIGINAL entry left pending beside a confirmed REPLY entry follows it. Entries looked up before
 * are stale afterwards. */
static __always_inline void ct_try_confirm(struct pkt *p, struct ct_key *rk, struct ct_key *ok)
{
	struct ct_new_val *r = bpf_map_lookup_elem(&usp_ct_new, rk);
	struct ct_new_val *o;

	if (r) {
		if (!ct_confirms(p, r) || ct_promote(rk, r) < 0)
			return;
	} else if (!ct_confirmed(rk)) {
		return;
	}
	if (!ok)
		return;
	o = bpf_map_lookup_elem(&usp_ct_new, ok);
	if (o)
		ct_promote(ok, o);
}

/* The REPLY key of the flow whose ORIGINAL entry `o` the client packet `p` found. */
static __always_inline void ct_reply_key(const struct pkt *p, const struct ct_val *o, struct ct_key *rk)
{
	rk->saddr = o->nat_daddr;
	rk->daddr = o->nat_saddr ? o->nat_saddr : p->t.saddr;
	rk->sport = o->nat_dport;
	rk->dport = o->nat_saddr ? o->nat_sport : p->t.sport;
	rk->proto = p->t.proto;
	rk->dir = CT_REPLY;
	rk->pad = 0;
}

/* Whether `p` may open a flow: a UDP datagram (its first fragment), a TCP SYN without ACK, RST
 * or FIN. Anything else of a flow no table holds opens none. */
static __always_inline int ct_may_open(const struct pkt *p)
{
	if (p->frag == FRAG_LATER)
		return 0;
	if (p->t.proto != IPPROTO_TCP)
		return 1;
	return (p->tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN)) == TCP_SYN;
}

/* -- rewriting and sending ----------------------------------------------------------------- */

static __always_inline int set_addr(struct __sk_buff *skb, struct pkt *p, __u32 off, __u32 old, __u32 new)
{
	__u64 l4 = BPF_F_PSEUDO_HDR | sizeof(new) | (p->t.proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0);

	if (old == new)
		return 0;
	if (p->csum_off && bpf_l4_csum_replace(skb, p->csum_off, old, new, l4) < 0)
		return -1;
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline int set_port(struct __sk_buff *skb, struct pkt *p, __u32 off, __u16 old, __u16 new)
{
	__u64 l4 = sizeof(new) | (p->t.proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0);

	if (old == new || p->frag == FRAG_LATER)	/* a later fragment has no ports to rewrite */
		return 0;
	if (p->csum_off && bpf_l4_csum_replace(skb, p->csum_off, old, new, l4) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

/* Rewrite the packet's tuple to (saddr:sport -> daddr:dport), checksums included. A first
 * fragment's L4 checksum covers the whole datagram: the incremental update is right for it too. */
static __always_inline int rewrite(struct __sk_buff *skb, struct pkt *p, __u32 saddr, __u16 sport,
				   __u32 daddr, __u16 dport)
{
	if (set_addr(skb, p, IP_SRC_OFF, p->t.saddr, saddr) < 0 ||
	    set_addr(skb, p, IP_DST_OFF, p->t.daddr, daddr) < 0 ||
	    set_port(skb, p, p->l4_off, p->t.sport, sport) < 0 ||
	    set_port(skb, p, p->l4_off + 2, p->t.dport, dport) < 0)
		return -1;
	return 0;
}

/* The interface the route to `daddr` leaves through, or 0. */
static __always_inline __u32 route_ifindex(struct __sk_buff *skb, __u32 saddr, __u32 daddr)
{
	struct bpf_fib_lookup fib = {};
	long rc;

	fib.family = AF_INET_;
	fib.ipv4_src = saddr;
	fib.ipv4_dst = daddr;
	fib.ifindex = skb->ifindex;
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_SKIP_NEIGH);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	return fib.ifindex;
}

/* Send a rewritten packet towards its new destination; the kernel resolves the next hop. */
static __always_inline int send(struct __sk_buff *skb, __u32 saddr, __u32 daddr)
{
	__u32 ifindex = route_ifindex(skb, saddr, daddr);

	if (!ifindex)
		return TC_ACT_SHOT;
	return bpf_redirect_neigh(ifindex, NULL, 0, 0);
}

static __always_inline int reply_nat(struct __sk_buff *skb, struct pkt *p, __u64 now, int ingress)
{
	struct ct_new_val *pending;
	struct ct_key k = p->t;
	struct ct_val *v;

	k.dir = CT_REPLY;
	v = ct_get(&k, p, now, &pending);
	if (!v)
		return -1;
	if (pending)
		ct_saw_reply(p, pending);
	if (rewrite(skb, p, v->nat_saddr, v->nat_sport, v->nat_daddr, v->nat_dport) < 0)
		return TC_ACT_SHOT;
	return ingress ? send(skb, v->nat_saddr, v->nat_daddr) : TC_ACT_OK;
}

static __always_inline __u64 flow_hash(const struct pkt *p);	/* xdp_lb.h */

static __always_inline __u32 tc_pick(struct pkt *p, struct svc_val *svc)
{
	struct slot_key sk = { .svc_id = svc->id };
	__u32 *id;
	__u64 h;

	if (svc->flags & F_MAGLEV) {
		/* the flow's tuple, so every node sends one flow to one backend */
		h = flow_hash(p);
		__u32 mid = pick_maglev(svc, h);

		if (mid)
			return mid;
	} else if (svc->flags & F_ROUND_ROBIN) {
		h = __sync_fetch_and_add(&svc->rr, 1);
	} else {
		h = bpf_get_prandom_u32();
	}
	if (!svc->count)
		return 0;
	sk.slot = (__u32)(h % svc->count) + 1;
	id = bpf_map_lookup_elem(&usp_slots, &sk);
	return id ? *id : 0;
}

/* A source port for the SNATed flow no other flow to this backend uses: the client's own, else a
 * hashed one, a handful of tries. A port of a flow not yet confirmed may be taken over when every
 * try is in use (the older flow loses, as in a flood of new flows); a confirmed flow's never is:
 * 0 when every port tried is one (the new flow is dropped). */
static __always_inline __u16 snat_port(struct pkt *p, __u32 snat, __u32 be_addr, __u16 be_port)
{
	struct ct_key rk = { .saddr = be_addr, .daddr = snat, .sport = be_port, .proto = p->t.proto,
			     .dir = CT_REPLY };
	__u32 h = (__u32)mix64((__u64)p->t.saddr << 16 | p->t.sport);
	__u16 port = p->t.sport, fallback = 0;
	struct ct_new_val *n;
	struct ct_val *old;
	int i;

	/* unrolled: Linux before 6.4 refuses a loop whose back-edge follows a helper call
	 * ("back-edge from insn ..."), and the lab's 6.1 guests run these programs */
#pragma unroll
	for (i = 0; i < SNAT_TRIES; i++) {
		rk.dport = port;
		old = ct_confirmed(&rk);
		if (old && old->nat_daddr == p->t.saddr && old->nat_dport == p->t.sport)
			return port;
		if (!old) {
			n = bpf_map_lookup_elem(&usp_ct_new, &rk);
			if (!n || (n->v.nat_daddr == p->t.saddr && n->v.nat_dport == p->t.sport))
				return port;
			if (!fallback)
				fallback = port;
		}
		port = bpf_htons(SNAT_PORT_MIN + (h + i * 7919) % SNAT_PORT_SPAN);
	}
	return fallback;
}

/* Both entries of a new flow, in usp_ct_new until the flow is confirmed. */
static __always_inline int ct_create(struct pkt *p, struct svc_val *svc, __u32 be_id,
				     struct backend_val *be, __u32 snat, __u16 sport, __u64 now)
{
	struct ct_key rk = { .saddr = be->addr[3], .sport = (__u16)be->port, .proto = p->t.proto,
			     .dir = CT_REPLY };
	struct ct_new_val fv = { .v = { .nat_saddr = snat, .nat_daddr = be->addr[3], .nat_sport = sport,
					.nat_dport = (__u16)be->port, .svc_id = svc->id, .backend_id = be_id,
					.created = now, .last = now, .packets = 1 } };
	struct ct_new_val rv = fv;

	rk.daddr = snat ? snat : p->t.saddr;
	rk.dport = snat ? sport : p->t.sport;
	rv.v.nat_saddr = p->t.daddr;
	rv.v.nat_sport = p->t.dport;
	rv.v.nat_daddr = p->t.saddr;
	rv.v.nat_dport = p->t.sport;
	rv.v.packets = 0;
	ct_delete(&rk);		/* a pending flow that held the tuple (snat_port) loses it */
	if (bpf_map_update_elem(&usp_ct_new, &rk, &rv, BPF_ANY) < 0)
		return -1;
	ct_confirmed_delete(&p->t);
	return bpf_map_update_elem(&usp_ct_new, &p->t, &fv, BPF_ANY);
}

#include "dsr.h"		/* --bpf-lb-mode dsr: its hooks below */
#include "tc_frontends.h"
#include "icmp_error.h"		/* ICMP errors of known flows, reverse-NATed */

/* A new flow to a NodePort, LB IP or externalIP: TC_ACT_OK when it is none of ours. */
static __always_inline int nodeport_new(struct __sk_buff *skb, struct pkt *p, __u64 now)
{
	struct backend_val *be;
	struct svc_val *svc;
	__u32 id, ifindex, snat = 0, *ifaddr;
	__u16 sport = p->t.sport;
	int ret, verdict;

	svc = tc_frontend(p);
	if (!svc)
		return TC_ACT_OK;
	verdict = tc_admit(p, svc);
	if (verdict != TC_ADMIT)
		return verdict;
	if (!ct_may_open(p))
		return dsr_stateless(skb, p, svc, now);
	id = tc_select(p, svc, now);
	be = backend_of(svc, id);
	if (!be || !is_v4_mapped(be->addr))
		return TC_ACT_SHOT;
	ret = dsr_new(skb, p, svc, id, be, now);
	if (ret >= 0)
		return ret;
	ifindex = route_ifindex(skb, p->t.saddr, be->addr[3]);
	if (!ifindex)
		return TC_ACT_SHOT;
	ifaddr = bpf_map_lookup_elem(&usp_tc_ifaces, &ifindex);
	if (ifaddr && !(svc->flags & F_LOCAL_ONLY)) {
		snat = *ifaddr;
		sport = snat_port(p, snat, be->addr[3], (__u16)be->port);
		if (!sport)
			return TC_ACT_SHOT;	/* every port tried is a confirmed flow's */
	}
	__sync_fetch_and_add(&be->selected, 1);
	if (ct_create(p, svc, id, be, snat, sport, now) < 0)
		return TC_ACT_SHOT;
	if (rewrite(skb, p, snat ? snat : p->t.saddr, sport, be->addr[3], (__u16)be->port) < 0)
		return TC_ACT_SHOT;
	return send(skb, snat ? snat : p->t.saddr, be->addr[3]);
}

/* A packet of a known flow goes where its first one went, while that backend is still the
 * Service's; otherwise -1 (a new selection). A client packet of a pending flow may confirm it; a
 * TCP SYN on a closing entry opens a new flow (the client reuses its port: -1). */
static __always_inline int nodeport_known(struct __sk_buff *skb, struct pkt *p, __u64 now)
{
	struct ct_new_val *pending;
	struct ct_val *found = ct_find(&p->t, now, &pending);
	struct backend_val *be;
	struct ct_key rk;
	struct ct_val v;
	__u32 saddr;
	__u16 sport;
	int ret;

	if (!found)
		return -1;
	ct_reply_key(p, found, &rk);
	be = bpf_map_lookup_elem(&usp_backends, &found->backend_id);
	if (!be || be->addr[3] != found->nat_daddr || (__u16)be->port != found->nat_dport ||
	    ((found->flags & CT_CLOSING) && p->t.proto == IPPROTO_TCP && ct_may_open(p))) {
		if (!(found->flags & CT_DSR))
			ct_delete(&rk);
		ct_delete(&p->t);
		return -1;
	}
	ct_touch(&p->t, found, p, now);
	v = *found;	/* the entry may move to the confirmed table below */
	if (pending && !(v.flags & CT_DSR))
		ct_try_confirm(p, &rk, &p->t);
	ret = dsr_known(skb, p, &v);
	if (ret >= 0)
		return ret;
	saddr = v.nat_saddr ? v.nat_saddr : p->t.saddr;
	sport = v.nat_saddr ? v.nat_sport : p->t.sport;
	if (rewrite(skb, p, saddr, sport, v.nat_daddr, v.nat_dport) < 0)
		return TC_ACT_SHOT;
	return send(skb, saddr, v.nat_daddr);
}

SEC("tc")
int usp_tc_ingress(struct __sk_buff *skb)
{
	__u64 now = bpf_ktime_get_ns();
	struct pkt p = {};
	int ret;

	ret = parse(skb, &p);
	if (ret == PARSE_ICMP)
		return icmp_error(skb, &p, now, 1);
	if (ret < 0)
		return TC_ACT_OK;
	ret = reply_nat(skb, &p, now, 1);
	if (ret >= 0)
		return ret;
	ret = nodeport_known(skb, &p, now);
	if (ret >= 0)
		return ret;
	ret = dsr_recv(skb, &p, now);
	if (ret >= 0)
		return ret;
	return nodeport_new(skb, &p, now);
}

SEC("tc")
int usp_tc_egress(struct __sk_buff *skb)
{
	__u64 now = bpf_ktime_get_ns();
	struct pkt p = {};
	int ret;

	ret = parse(skb, &p);
	if (ret == PARSE_ICMP)
		return icmp_error(skb, &p, now, 0);
	if (ret < 0)
		return TC_ACT_OK;
	ret = reply_nat(skb, &p, now, 0);
	return ret >= 0 ? ret : TC_ACT_OK;
}

#include "xdp_lb.h"

char LICENSE[] SEC("license") = "GPL";
