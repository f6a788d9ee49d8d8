// kpeer: the Linux-kernel side of the smc-rs <-> kernel AF_SMC interop harness
// (scripts/vm/run-kernel-interop.sh). Runs inside the test VMs, which have no
// python: everything the harness asks the kernel goes through this program.
//
//   kpeer server --port P --conns N [--family smc|tcp] [--case C] [--timeout S]
//   kpeer client --connect IP:PORT --rounds R[,R..] [--bytes N] [--close client|server|alt]
//                [--family smc|tcp] [--case C] [--timeout S] [--retry S]
//   kpeer gen SEED BYTES            the generator stream (the host hashes it for the expected SHA-256)
//   kpeer diag [--wait-empty S]     the kernel's AF_SMC sockets (smc_diag), optionally until none is left
//   kpeer lgr                       SMC-R link groups and links (SMC_GEN_NETLINK dumps)
//   kpeer ueid add NAME | flush | list
//   kpeer stats                     SMC-R handshake counters and fallback reasons
//
// Connection protocol, shared with the smc-rs peer (crates/smc-interop, `smc-iop-peer`):
// the client sends a 32-byte header {"SMCIOP1\0", u64 BE client->server bytes,
// u64 BE server->client bytes, u32 BE connection id, u8 closer (0 client, 1 server),
// 3 zero bytes}; then both ends send their stream at once and read the other's.
// Stream bytes: seed = 2*id (client->server) or 2*id+1 (server->client); byte i is
// byte i%8 (little-endian) of splitmix64((seed << 40) + i/8). Once an end has sent
// and received everything, the closer closes; the other end waits for EOF, then closes.
// The receiver pipes what it read into sha256sum; the host compares that with the
// hash of `kpeer gen`.
//
// Every result is one line on stdout, "SMCI-<WHAT> key=value ...", which the host
// reads from the serial log. A watchdog ends the program after --timeout seconds
// and reports each unfinished connection as a hang. Exit status: 0 if every
// connection succeeded, 1 if one failed, 2 for bad arguments, 3 on the watchdog.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/genetlink.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/smc.h>
#include <linux/smc_diag.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef AF_SMC
#define AF_SMC 43
#endif
#define SMCPROTO_SMC 0 /* IPv4 (net/smc/af_smc.c smc_create) */

extern char **environ;
static const char *case_name = "-";
static double t_start;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* One line per call: stdout is shared by all threads and read line by line. */
static void out(const char *fmt, ...)
{
	char line[2048];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if (n > (int)sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	if (write(1, line, n) < 0) { /* nothing to do: stdout is the serial console */ }
}

static void die(const char *fmt, ...)
{
	char m[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(m, sizeof(m), fmt, ap);
	va_end(ap);
	fprintf(stderr, "kpeer: %s\n", m);
	exit(2);
}

/* ---------------------------------------------------------------- generator */

static uint64_t splitmix64(uint64_t x)
{
	uint64_t z = x + 0x9e3779b97f4a7c15ULL;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/* Fills buf with stream bytes [off, off+n) of seed. */
static void gen_fill(uint8_t *buf, size_t n, uint64_t seed, uint64_t off)
{
	uint64_t base = seed << 40;
	size_t k = 0;
	while (k < n) {
		uint64_t i = off + k;
		uint64_t w = splitmix64(base + i / 8);
		for (unsigned b = i % 8; b < 8 && k < n; b++, k++)
			buf[k] = (uint8_t)(w >> (8 * b));
	}
}

static uint64_t parse_size(const char *s)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || end == s)
		die("bad size '%s'", s);
	switch (*end) {
	case 'K': case 'k': v <<= 10; end++; break;
	case 'M': case 'm': v <<= 20; end++; break;
	case 'G': case 'g': v <<= 30; end++; break;
	}
	if (*end)
		die("bad size '%s' (a number, optionally followed by K, M or G)", s);
	return v;
}

static long parse_num(const char *s, const char *what, long min, long max)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < min || v > max)
		die("bad %s '%s' (expected %ld..%ld)", what, s, min, max);
	return v;
}

/* ---------------------------------------------------------------- smc_diag */

struct diag_info {
	int found;
	char mode[16];
	uint32_t reason, peer;
	char gid[48], peer_gid[48];
	int role; /* -1 unknown, 0 client, 1 server */
};

static const char *diag_mode_name(int m)
{
	return m == SMC_DIAG_MODE_SMCR ? "SMCR" : m == SMC_DIAG_MODE_FALLBACK_TCP ? "TCP" : m == SMC_DIAG_MODE_SMCD ? "SMCD" : "?";
}

typedef void (*diag_cb)(const struct smc_diag_msg *m, const struct diag_info *d, void *arg);

/* Dumps every AF_SMC socket of this netns (net/smc/smc_diag.c smc_diag_dump). */
static int diag_dump(diag_cb cb, void *arg)
{
	int nl = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
	if (nl < 0)
		return -errno;
	struct {
		struct nlmsghdr nlh;
		struct smc_diag_req r;
	} req;
	memset(&req, 0, sizeof(req));
	req.nlh.nlmsg_len = sizeof(req);
	req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
	req.nlh.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
	req.r.diag_family = AF_SMC;
	req.r.diag_ext = (1 << (SMC_DIAG_LGRINFO - 1)) | (1 << (SMC_DIAG_FALLBACK - 1));
	if (send(nl, &req, sizeof(req), 0) < 0) {
		int e = -errno;
		close(nl);
		return e;
	}
	static __thread char buf[32768];
	int count = 0, rc = 0;
	for (;;) {
		int len = recv(nl, buf, sizeof(buf), 0);
		if (len <= 0) {
			rc = len < 0 ? -errno : -EIO;
			break;
		}
		for (struct nlmsghdr *h = (void *)buf; NLMSG_OK(h, len); h = NLMSG_NEXT(h, len)) {
			if (h->nlmsg_type == NLMSG_DONE)
				goto done;
			if (h->nlmsg_type == NLMSG_ERROR) {
				rc = ((struct nlmsgerr *)NLMSG_DATA(h))->error;
				goto done;
			}
			const struct smc_diag_msg *m = NLMSG_DATA(h);
			struct diag_info d = { .found = 1, .role = -1 };
			snprintf(d.mode, sizeof(d.mode), "%s", diag_mode_name(m->diag_mode));
			int alen = h->nlmsg_len - NLMSG_LENGTH(sizeof(*m));
			for (struct rtattr *a = (void *)(m + 1); RTA_OK(a, alen); a = RTA_NEXT(a, alen)) {
				if (a->rta_type == SMC_DIAG_FALLBACK && RTA_PAYLOAD(a) >= sizeof(struct smc_diag_fallback)) {
					const struct smc_diag_fallback *f = RTA_DATA(a);
					d.reason = f->reason;
					d.peer = f->peer_diagnosis;
				} else if (a->rta_type == SMC_DIAG_LGRINFO && RTA_PAYLOAD(a) >= sizeof(struct smc_diag_lgrinfo)) {
					const struct smc_diag_lgrinfo *l = RTA_DATA(a);
					d.role = l->role;
					snprintf(d.gid, sizeof(d.gid), "%.40s", (const char *)l->lnk[0].gid);
					snprintf(d.peer_gid, sizeof(d.peer_gid), "%.40s", (const char *)l->lnk[0].peer_gid);
				}
			}
			count++;
			if (cb)
				cb(m, &d, arg);
		}
	}
done:
	close(nl);
	return rc < 0 ? rc : count;
}

struct diag_match {
	uint16_t lport, rport;
	struct diag_info info;
};

static void diag_match_cb(const struct smc_diag_msg *m, const struct diag_info *d, void *arg)
{
	struct diag_match *w = arg;
	if (ntohs(m->id.idiag_sport) == w->lport && ntohs(m->id.idiag_dport) == w->rport)
		w->info = *d;
}

/* The kernel's view of one of our sockets, found by its ports. */
static struct diag_info diag_of(int fd)
{
	struct sockaddr_in l = { 0 }, r = { 0 };
	socklen_t ll = sizeof(l), rl = sizeof(r);
	struct diag_match w = { 0 };
	if (getsockname(fd, (void *)&l, &ll) == 0 && getpeername(fd, (void *)&r, &rl) == 0) {
		w.lport = ntohs(l.sin_port);
		w.rport = ntohs(r.sin_port);
		diag_dump(diag_match_cb, &w);
	}
	if (!w.info.found)
		snprintf(w.info.mode, sizeof(w.info.mode), "none");
	return w.info;
}

static void diag_print_cb(const struct smc_diag_msg *m, const struct diag_info *d, void *arg)
{
	(void)arg;
	char src[64], dst[64];
	int fa = m->diag_family == AF_INET6 ? AF_INET6 : AF_INET;
	inet_ntop(fa, m->id.idiag_src, src, sizeof(src));
	inet_ntop(fa, m->id.idiag_dst, dst, sizeof(dst));
	out("SMCI-KSOCK case=%s state=%u mode=%s local=%s:%u peer=%s:%u fb=0x%08x peer_fb=0x%08x gid=%s peer_gid=%s",
	    case_name, m->diag_state, d->mode, src, ntohs(m->id.idiag_sport), dst, ntohs(m->id.idiag_dport), d->reason,
	    d->peer, d->gid[0] ? d->gid : "-", d->peer_gid[0] ? d->peer_gid : "-");
}

/* ---------------------------------------------------------------- generic netlink (SMC_GEN_NETLINK) */

struct nla {
	int type;
	const uint8_t *v;
	int len;
};

static int nla_put(uint8_t *p, int type, const void *v, int len)
{
	uint16_t l = 4 + len, t = type;
	memcpy(p, &l, 2);
	memcpy(p + 2, &t, 2);
	memcpy(p + 4, v, len);
	int tot = NLA_ALIGN(l);
	memset(p + l, 0, tot - l);
	return tot;
}

static int nla_parse(const uint8_t *b, int len, struct nla *outv, int max)
{
	int n = 0, o = 0;
	while (o + 4 <= len && n < max) {
		uint16_t l, t;
		memcpy(&l, b + o, 2);
		memcpy(&t, b + o + 2, 2);
		if (l < 4 || o + l > len)
			break;
		outv[n].type = t & NLA_TYPE_MASK;
		outv[n].v = b + o + 4;
		outv[n].len = l - 4;
		n++;
		o += NLA_ALIGN(l);
	}
	return n;
}

static uint64_t nla_num(const struct nla *a)
{
	uint64_t v = 0;
	if (a->len == 1)
		v = a->v[0];
	else if (a->len == 2) {
		uint16_t x;
		memcpy(&x, a->v, 2);
		v = x;
	} else if (a->len == 4) {
		uint32_t x;
		memcpy(&x, a->v, 4);
		v = x;
	} else if (a->len == 8)
		memcpy(&v, a->v, 8);
	return v;
}

static void nla_str(const struct nla *a, char *dst, size_t n)
{
	size_t k = 0;
	for (int i = 0; i < a->len && k + 1 < n && a->v[i]; i++)
		dst[k++] = isgraph(a->v[i]) ? a->v[i] : '_';
	dst[k] = 0;
}

typedef void (*genl_cb)(const uint8_t *attrs, int len, void *arg);

struct genl {
	int fd, family, seq;
};

static int genl_req(struct genl *g, int family, int cmd, const uint8_t *attrs, int alen, int flags, genl_cb cb, void *arg)
{
	uint8_t m[1024];
	struct nlmsghdr *h = (void *)m;
	struct genlmsghdr *gh = NLMSG_DATA(h);
	if (alen > (int)sizeof(m) - 64)
		return -EINVAL;
	h->nlmsg_len = NLMSG_LENGTH(GENL_HDRLEN + alen);
	h->nlmsg_type = family;
	h->nlmsg_flags = flags;
	h->nlmsg_seq = ++g->seq;
	h->nlmsg_pid = 0;
	gh->cmd = cmd;
	gh->version = SMC_GENL_FAMILY_VERSION;
	gh->reserved = 0;
	memcpy((uint8_t *)gh + GENL_HDRLEN, attrs, alen);
	if (send(g->fd, m, h->nlmsg_len, 0) < 0)
		return -errno;
	static __thread char buf[65536];
	for (;;) {
		int len = recv(g->fd, buf, sizeof(buf), 0);
		if (len <= 0)
			return -EIO;
		for (struct nlmsghdr *r = (void *)buf; NLMSG_OK(r, len); r = NLMSG_NEXT(r, len)) {
			if (r->nlmsg_type == NLMSG_DONE)
				return 0;
			if (r->nlmsg_type == NLMSG_ERROR) {
				int e = ((struct nlmsgerr *)NLMSG_DATA(r))->error;
				if (e || !(flags & NLM_F_DUMP))
					return e;
				continue;
			}
			if (cb)
				cb((uint8_t *)NLMSG_DATA(r) + GENL_HDRLEN, r->nlmsg_len - NLMSG_LENGTH(GENL_HDRLEN), arg);
			if (!(flags & NLM_F_DUMP) && !(flags & NLM_F_ACK))
				return 0;
		}
	}
}

static void family_cb(const uint8_t *b, int len, void *arg)
{
	struct nla a[32];
	int n = nla_parse(b, len, a, 32);
	for (int i = 0; i < n; i++)
		if (a[i].type == CTRL_ATTR_FAMILY_ID)
			*(int *)arg = (int)nla_num(&a[i]);
}

static int genl_open(struct genl *g)
{
	g->seq = 0;
	g->family = 0;
	g->fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_GENERIC);
	struct sockaddr_nl sa = { .nl_family = AF_NETLINK };
	if (g->fd < 0 || bind(g->fd, (void *)&sa, sizeof(sa)))
		return -errno;
	uint8_t at[64];
	int al = nla_put(at, CTRL_ATTR_FAMILY_NAME, SMC_GENL_FAMILY_NAME, sizeof(SMC_GENL_FAMILY_NAME));
	int rc = genl_req(g, GENL_ID_CTRL, CTRL_CMD_GETFAMILY, at, al, NLM_F_REQUEST, family_cb, &g->family);
	if (rc || !g->family) {
		close(g->fd);
		return rc ? rc : -ENOENT;
	}
	return 0;
}

/* Link groups: ids (SMC_NLA_LGR_R_ID is unique per host and never reused while the
 * module is loaded, net/smc/smc_core.c smc_lgr_create), so the host can tell which
 * groups a case created, whatever earlier cases left behind. */
struct lgr_list {
	int n, links;
	uint32_t id[64];
	char line[4096];
	size_t used;
	/* per link: its RDMA device and connections, "rxe0:3,rxe1:2" */
	char lconns[1024];
	size_t lused;
};

static void lgr_cb(const uint8_t *b, int len, void *arg)
{
	struct lgr_list *L = arg;
	struct nla top[8], a[32];
	int nt = nla_parse(b, len, top, 8);
	for (int i = 0; i < nt; i++) {
		if (top[i].type != SMC_GEN_LGR_SMCR)
			continue;
		int n = nla_parse(top[i].v, top[i].len, a, 32);
		uint32_t id = 0, conns = 0;
		int role = -1;
		for (int j = 0; j < n; j++) {
			if (a[j].type == SMC_NLA_LGR_R_ID)
				id = nla_num(&a[j]);
			else if (a[j].type == SMC_NLA_LGR_R_ROLE)
				role = nla_num(&a[j]);
			else if (a[j].type == SMC_NLA_LGR_R_CONNS_NUM)
				conns = nla_num(&a[j]);
		}
		if (L->n < 64)
			L->id[L->n] = id;
		L->n++;
		if (L->used < sizeof(L->line) - 64)
			L->used += snprintf(L->line + L->used, sizeof(L->line) - L->used, "%s%08x:%s:%u", L->used ? "," : "", id,
					    role == 0 ? "C" : role == 1 ? "S" : "?", conns);
	}
}

static void link_cb(const uint8_t *b, int len, void *arg)
{
	struct lgr_list *L = arg;
	struct nla top[8];
	int nt = nla_parse(b, len, top, 8);
	for (int i = 0; i < nt; i++) {
		if (top[i].type != SMC_GEN_LINK_SMCR)
			continue;
		L->links++;
		struct nla a[32];
		int n = nla_parse(top[i].v, top[i].len, a, 32);
		char dev[64] = "?";
		uint32_t conns = 0;
		for (int j = 0; j < n; j++) {
			if (a[j].type == SMC_NLA_LINK_IB_DEV && a[j].len > 0)
				snprintf(dev, sizeof(dev), "%.*s", a[j].len, (const char *)a[j].v);
			else if (a[j].type == SMC_NLA_LINK_CONN_CNT)
				conns = nla_num(&a[j]);
		}
		if (L->lused < sizeof(L->lconns) - 80)
			L->lused += snprintf(L->lconns + L->lused, sizeof(L->lconns) - L->lused, "%s%s:%u",
					     L->lused ? "," : "", dev, conns);
	}
}

/* "lgrs=N links=M ids=ID:ROLE:CONNS,... lconns=DEV:CONNS,..." for SMCI lines; returns -errno on
 * failure. */
static int lgr_summary(char *dst, size_t n)
{
	struct genl g;
	struct lgr_list L;
	memset(&L, 0, sizeof(L));
	int rc = genl_open(&g);
	if (rc)
		return rc;
	rc = genl_req(&g, g.family, SMC_NETLINK_GET_LGR_SMCR, NULL, 0, NLM_F_REQUEST | NLM_F_DUMP, lgr_cb, &L);
	if (!rc)
		rc = genl_req(&g, g.family, SMC_NETLINK_GET_LINK_SMCR, NULL, 0, NLM_F_REQUEST | NLM_F_DUMP, link_cb, &L);
	close(g.fd);
	if (rc)
		return rc;
	snprintf(dst, n, "lgrs=%d links=%d ids=%s lconns=%s", L.n, L.links, L.used ? L.line : "-",
		 L.lused ? L.lconns : "-");
	return 0;
}

static void ueid_cb(const uint8_t *b, int len, void *arg)
{
	struct nla a[8];
	int n = nla_parse(b, len, a, 8);
	for (int i = 0; i < n; i++) {
		char s[64];
		nla_str(&a[i], s, sizeof(s));
		out("SMCI-UEID case=%s ueid=%s", case_name, s);
		(*(int *)arg)++;
	}
}

static const char *stat_name(int k)
{
	switch (k) {
	case SMC_NLA_STATS_T_CLNT_V1_SUCC: return "clnt_v1_succ";
	case SMC_NLA_STATS_T_CLNT_V2_SUCC: return "clnt_v2_succ";
	case SMC_NLA_STATS_T_SRV_V1_SUCC: return "srv_v1_succ";
	case SMC_NLA_STATS_T_SRV_V2_SUCC: return "srv_v2_succ";
	case SMC_NLA_STATS_T_RX_BYTES: return "rx_bytes";
	case SMC_NLA_STATS_T_TX_BYTES: return "tx_bytes";
	default: return NULL;
	}
}

static void stats_cb(const uint8_t *b, int len, void *arg)
{
	(void)arg;
	struct nla top[8], in[32], t[64];
	int nt = nla_parse(b, len, top, 8);
	for (int i = 0; i < nt; i++) {
		if (top[i].type != SMC_GEN_STATS)
			continue;
		int m = nla_parse(top[i].v, top[i].len, in, 32);
		char line[1024];
		size_t o = snprintf(line, sizeof(line), "SMCI-KSTATS case=%s", case_name);
		for (int j = 0; j < m; j++) {
			if (in[j].type == SMC_NLA_STATS_SMCR_TECH) {
				int q = nla_parse(in[j].v, in[j].len, t, 64);
				for (int k = 0; k < q; k++)
					if (stat_name(t[k].type) && o < sizeof(line) - 64)
						o += snprintf(line + o, sizeof(line) - o, " %s=%llu", stat_name(t[k].type),
							      (unsigned long long)nla_num(&t[k]));
			} else if ((in[j].type == SMC_NLA_STATS_CLNT_HS_ERR_CNT || in[j].type == SMC_NLA_STATS_SRV_HS_ERR_CNT) &&
				   o < sizeof(line) - 64)
				o += snprintf(line + o, sizeof(line) - o, " %s_hs_err=%llu",
					      in[j].type == SMC_NLA_STATS_CLNT_HS_ERR_CNT ? "clnt" : "srv",
					      (unsigned long long)nla_num(&in[j]));
		}
		out("%s", line);
	}
}

static void fback_cb(const uint8_t *b, int len, void *arg)
{
	(void)arg;
	struct nla top[8], in[16];
	int nt = nla_parse(b, len, top, 8);
	for (int i = 0; i < nt; i++) {
		if (top[i].type != SMC_GEN_FBACK_STATS)
			continue;
		int m = nla_parse(top[i].v, top[i].len, in, 16);
		uint64_t d[8] = { 0 };
		for (int j = 0; j < m; j++)
			if (in[j].type >= 0 && in[j].type < 8)
				d[in[j].type] = nla_num(&in[j]);
		out("SMCI-KFBACK case=%s srv=%llu clnt=%llu reason=0x%08llx count=%llu", case_name,
		    (unsigned long long)d[SMC_NLA_FBACK_STATS_SRV_CNT], (unsigned long long)d[SMC_NLA_FBACK_STATS_CLNT_CNT],
		    (unsigned long long)d[SMC_NLA_FBACK_STATS_RSN_CODE], (unsigned long long)d[SMC_NLA_FBACK_STATS_RSN_CNT]);
	}
}

static int cmd_genl(int argc, char **argv)
{
	struct genl g;
	int rc = genl_open(&g);
	if (rc)
		die("no %s generic netlink family (is the smc module loaded?): %s", SMC_GENL_FAMILY_NAME, strerror(-rc));
	const char *w = argv[0];
	if (!strcmp(w, "lgr")) {
		close(g.fd);
		char s[5400];
		rc = lgr_summary(s, sizeof(s));
		if (rc)
			die("link group dump: %s", strerror(-rc));
		out("SMCI-KLGR case=%s %s", case_name, s);
		return 0;
	}
	if (!strcmp(w, "stats")) {
		rc = genl_req(&g, g.family, SMC_NETLINK_GET_STATS, NULL, 0, NLM_F_REQUEST | NLM_F_DUMP, stats_cb, NULL);
		if (!rc)
			rc = genl_req(&g, g.family, SMC_NETLINK_GET_FBACK_STATS, NULL, 0, NLM_F_REQUEST | NLM_F_DUMP, fback_cb, NULL);
		if (rc)
			die("stats: %s", strerror(-rc));
		return 0;
	}
	/* ueid add NAME | flush | list (net/smc/smc_clc.c smc_nl_add_ueid: a 32-byte
	 * blank-padded upper-case string plus its NUL) */
	if (argc < 2)
		die("usage: kpeer ueid add NAME | flush | list");
	if (!strcmp(argv[1], "add")) {
		if (argc < 3 || !argv[2][0] || strlen(argv[2]) > SMC_MAX_EID_LEN)
			die("ueid add: a name of 1..%d characters", SMC_MAX_EID_LEN);
		char name[SMC_MAX_EID_LEN + 1];
		memset(name, ' ', SMC_MAX_EID_LEN);
		name[SMC_MAX_EID_LEN] = 0;
		for (size_t i = 0; argv[2][i]; i++)
			name[i] = toupper((unsigned char)argv[2][i]);
		uint8_t at[64];
		int al = nla_put(at, SMC_NLA_EID_TABLE_ENTRY, name, sizeof(name));
		rc = genl_req(&g, g.family, SMC_NETLINK_ADD_UEID, at, al, NLM_F_REQUEST | NLM_F_ACK, NULL, NULL);
		out("SMCI-UEID case=%s add=%s rc=%s", case_name, argv[2], rc ? strerror(-rc) : "ok");
		return !!rc;
	}
	if (!strcmp(argv[1], "flush")) {
		rc = genl_req(&g, g.family, SMC_NETLINK_FLUSH_UEID, NULL, 0, NLM_F_REQUEST | NLM_F_ACK, NULL, NULL);
		out("SMCI-UEID case=%s flush rc=%s", case_name, rc ? strerror(-rc) : "ok");
		return !!rc;
	}
	if (!strcmp(argv[1], "list")) {
		int n = 0;
		rc = genl_req(&g, g.family, SMC_NETLINK_DUMP_UEID, NULL, 0, NLM_F_REQUEST | NLM_F_DUMP, ueid_cb, &n);
		out("SMCI-UEID case=%s count=%d rc=%s", case_name, n, rc ? strerror(-rc) : "ok");
		return !!rc;
	}
	die("usage: kpeer ueid add NAME | flush | list");
	return 2;
}

/* ---------------------------------------------------------------- sha256sum child */

struct hasher {
	pid_t pid;
	int in, outfd;
};

/* Starts `sha256sum` reading a pipe (coreutils: the guest has no other hash tool). */
static int hasher_start(struct hasher *h)
{
	int pin[2], pout[2];
	if (pipe2(pin, O_CLOEXEC))
		return -errno;
	if (pipe2(pout, O_CLOEXEC)) {
		close(pin[0]);
		close(pin[1]);
		return -errno;
	}
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, pin[0], 0);
	posix_spawn_file_actions_adddup2(&fa, pout[1], 1);
	char *argv[] = { "sha256sum", NULL };
	int rc = posix_spawnp(&h->pid, "sha256sum", &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(pin[0]);
	close(pout[1]);
	if (rc) {
		close(pin[1]);
		close(pout[0]);
		return -rc;
	}
	h->in = pin[1];
	h->outfd = pout[0];
	return 0;
}

static int hasher_feed(struct hasher *h, const uint8_t *b, size_t n)
{
	while (n) {
		ssize_t w = write(h->in, b, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		b += w;
		n -= w;
	}
	return 0;
}

static void hasher_finish(struct hasher *h, char hex[65])
{
	close(h->in);
	size_t got = 0;
	char buf[128];
	for (;;) {
		ssize_t r = read(h->outfd, buf + got, sizeof(buf) - 1 - got);
		if (r <= 0)
			break;
		got += r;
	}
	close(h->outfd);
	waitpid(h->pid, NULL, 0);
	if (got >= 64) {
		memcpy(hex, buf, 64);
		hex[64] = 0;
	} else
		snprintf(hex, 65, "-");
}

/* ---------------------------------------------------------------- connections */

enum { CLOSER_CLIENT = 0, CLOSER_SERVER = 1 };
#define MAGIC "SMCIOP1"
#define HDR_LEN 32

struct conn {
	int fd, server, id, closer, urgent;
	uint64_t want_out, want_in;
	volatile uint64_t sent, recvd;
	volatile int64_t last_ns; /* last progress, CLOCK_MONOTONIC ns */
	volatile int done;
	int ok; /* everything arrived intact and the close went as asked */
	int werr;
	double t_connect, t_up;
	pthread_t th;
};

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void progress(struct conn *c)
{
	__atomic_store_n(&c->last_ns, now_ns(), __ATOMIC_RELAXED);
}

/* not an errno: the peer's stream ended before all its bytes arrived */
#define ERR_EOF (-1)

static const char *errname(int e)
{
	switch (e) {
	case 0: return "-";
	case ERR_EOF: return "EOF";
	case ECONNRESET: return "ECONNRESET";
	case ECONNABORTED: return "ECONNABORTED";
	case EPIPE: return "EPIPE";
	case ETIMEDOUT: return "ETIMEDOUT";
	case EAGAIN: return "EAGAIN";
	case ENOTCONN: return "ENOTCONN";
	case ECONNREFUSED: return "ECONNREFUSED";
	case EHOSTUNREACH: return "EHOSTUNREACH";
	case EIO: return "EIO";
	default: return "other";
	}
}

static void *writer(void *p)
{
	struct conn *c = p;
	static __thread uint8_t b[65536];
	uint64_t seed = 2 * (uint64_t)c->id + (c->server ? 1 : 0);
	while (c->sent < c->want_out) {
		size_t n = c->want_out - c->sent < sizeof(b) ? c->want_out - c->sent : sizeof(b);
		gen_fill(b, n, seed, c->sent);
		size_t o = 0;
		while (o < n) {
			ssize_t w = send(c->fd, b + o, n - o, MSG_NOSIGNAL);
			if (w < 0 && errno == EINTR)
				continue;
			if (w <= 0) {
				c->werr = w < 0 ? errno : EIO;
				return NULL;
			}
			o += w;
			c->sent += w;
			progress(c);
		}
	}
	return NULL;
}

static int read_full(int fd, void *b, size_t n)
{
	size_t o = 0;
	while (o < n) {
		ssize_t r = read(fd, (char *)b + o, n - o);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return r < 0 ? errno : EPIPE;
		o += r;
	}
	return 0;
}

#define URGENT_FROM_CLIENT 0xC1
#define URGENT_FROM_SERVER 0x5E

/* Waits (30 s at most) for the peer's urgent byte: POLLPRI, then recv(MSG_OOB).
 * Returns the byte, -1 if none came, -2 - errno on an error. */
static int urgent_wait(int fd)
{
	double give_up = now() + 30;
	while (now() < give_up) {
		struct pollfd pfd = { .fd = fd, .events = POLLPRI };
		int pr = poll(&pfd, 1, 1000);
		if (pr < 0 && errno == EINTR)
			continue;
		if (pr < 0)
			return -2 - errno;
		if (pr == 0 || !(pfd.revents & POLLPRI))
			continue;
		uint8_t b;
		ssize_t r = recv(fd, &b, 1, MSG_OOB);
		if (r == 1)
			return b;
		if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EINVAL))
			continue; /* announced, not yet there */
		return -2 - (r < 0 ? errno : EIO);
	}
	return -1;
}

/* In-band bytes before each urgent byte: byte i is i ^ the urgent byte. Not zero
 * on purpose: this kernel (net/smc/smc_rx.c, smc_rx_recv_urg) leaves an urgent
 * byte in band when recv(MSG_OOB) fetches it while it is the very next unread
 * byte, and the reader then waits forever for the stream's last byte. */
#define URGENT_PREFIX_LEN 64

static int urgent_send(struct conn *c, uint8_t mine)
{
	uint8_t p[URGENT_PREFIX_LEN];
	for (int i = 0; i < URGENT_PREFIX_LEN; i++)
		p[i] = (uint8_t)i ^ mine;
	if (send(c->fd, p, sizeof(p), MSG_NOSIGNAL) != (ssize_t)sizeof(p))
		return errno ? errno : EIO;
	if (send(c->fd, &mine, 1, MSG_OOB | MSG_NOSIGNAL) != 1)
		return errno ? errno : EIO;
	return 0;
}

/* The urgent bytes of a header with the urgent flag: the client sends its in-band
 * prefix and its byte out of band, the server waits for the byte (POLLPRI, then
 * recv(MSG_OOB)), reads the prefix in band and answers the same way; one SMCI-URG
 * line (same fields as smc-iop-peer's). The streams run afterwards either way. */
static void urgent_exchange(struct conn *c)
{
	uint8_t mine = c->server ? URGENT_FROM_SERVER : URGENT_FROM_CLIENT;
	int theirs = c->server ? URGENT_FROM_CLIENT : URGENT_FROM_SERVER, got = -1, err = 0;
	const char *prefix = "-";
	double t0 = now();
	if (!c->server)
		err = urgent_send(c, mine);
	if (!err) {
		got = urgent_wait(c->fd);
		if (got <= -2) {
			err = -2 - got;
			got = -1;
		}
	}
	if (!err && got >= 0) {
		uint8_t p[URGENT_PREFIX_LEN];
		err = read_full(c->fd, p, sizeof(p));
		if (!err) {
			prefix = "ok";
			for (int i = 0; i < URGENT_PREFIX_LEN; i++)
				if (p[i] != ((uint8_t)i ^ (uint8_t)theirs))
					prefix = "bad";
		}
	}
	if (!err && c->server)
		err = urgent_send(c, mine);
	progress(c);
	char gs[16] = "-";
	if (got >= 0)
		snprintf(gs, sizeof(gs), "0x%02x", got);
	out("SMCI-URG case=%s impl=kernel side=%s id=%d sent=0x%02x got=%s want=0x%02x prefix=%s ok=%s err=%s wait_s=%.3f",
	    case_name, c->server ? "server" : "client", c->id, mine, gs, theirs, prefix,
	    got == theirs && !strcmp(prefix, "ok") ? "yes" : "no", errname(err), now() - t0);
}

/* Runs one connection after connect/accept: header, both streams, close. */
static void run_conn(struct conn *c)
{
	const char *side = c->server ? "server" : "client";
	struct diag_info d = diag_of(c->fd);
	progress(c);
	uint8_t hdr[HDR_LEN];
	int err = 0;
	if (!c->server) {
		memset(hdr, 0, sizeof(hdr));
		memcpy(hdr, MAGIC, 8);
		for (int i = 0; i < 8; i++) {
			hdr[8 + i] = (uint8_t)(c->want_out >> (56 - 8 * i));
			hdr[16 + i] = (uint8_t)(c->want_in >> (56 - 8 * i));
		}
		for (int i = 0; i < 4; i++)
			hdr[24 + i] = (uint8_t)((uint32_t)c->id >> (24 - 8 * i));
		hdr[28] = (uint8_t)c->closer;
		hdr[29] = (uint8_t)c->urgent;
		if (send(c->fd, hdr, sizeof(hdr), MSG_NOSIGNAL) != sizeof(hdr))
			err = errno ? errno : EIO;
	} else {
		err = read_full(c->fd, hdr, sizeof(hdr));
		if (!err && memcmp(hdr, MAGIC, 8))
			err = EPROTO;
		if (!err) {
			c->want_in = c->want_out = 0;
			for (int i = 0; i < 8; i++) {
				c->want_in = c->want_in << 8 | hdr[8 + i];
				c->want_out = c->want_out << 8 | hdr[16 + i];
			}
			c->id = (int)((uint32_t)hdr[24] << 24 | (uint32_t)hdr[25] << 16 | (uint32_t)hdr[26] << 8 | hdr[27]);
			c->closer = hdr[28] ? CLOSER_SERVER : CLOSER_CLIENT;
			c->urgent = hdr[29] != 0;
		}
	}
	out("SMCI-CONN case=%s impl=kernel side=%s id=%d ev=up mode=%s fb=0x%08x peer_fb=0x%08x gid=%s peer_gid=%s connect_s=%.3f",
	    case_name, side, c->id, d.mode, d.reason, d.peer, d.gid[0] ? d.gid : "-", d.peer_gid[0] ? d.peer_gid : "-",
	    c->t_connect);
	if (err) {
		out("SMCI-CONN case=%s impl=kernel side=%s id=%d ev=end result=error err=%s at=header mode=%s fb=0x%08x peer_fb=0x%08x",
		    case_name, side, c->id, errname(err), d.mode, d.reason, d.peer);
		close(c->fd);
		c->done = 1;
		return;
	}
	if (c->urgent)
		urgent_exchange(c);
	struct hasher h;
	int hrc = hasher_start(&h);
	if (hrc)
		die("sha256sum: %s", strerror(-hrc));
	double t0 = now();
	pthread_t wt;
	if (pthread_create(&wt, NULL, writer, c))
		die("pthread_create");
	static __thread uint8_t b[1 << 18];
	const char *at = "-";
	while (c->recvd < c->want_in) {
		size_t want = c->want_in - c->recvd < sizeof(b) ? c->want_in - c->recvd : sizeof(b);
		ssize_t r = read(c->fd, b, want);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			err = r < 0 ? errno : ERR_EOF;
			at = "recv";
			break;
		}
		hasher_feed(&h, b, r);
		c->recvd += r;
		progress(c);
	}
	double stall = (now_ns() - __atomic_load_n(&c->last_ns, __ATOMIC_RELAXED)) / 1e9;
	if (err) /* no point in sending on: unblock the writer */
		shutdown(c->fd, SHUT_RDWR);
	pthread_join(wt, NULL);
	double xfer = now() - t0;
	if (!err && c->werr) {
		err = c->werr;
		at = "send";
		stall = (now_ns() - __atomic_load_n(&c->last_ns, __ATOMIC_RELAXED)) / 1e9;
	}
	char sha[65];
	hasher_finish(&h, sha);
	const char *close_role = "-", *eof = "-";
	if (!err) {
		int active = (c->closer == CLOSER_SERVER) == !!c->server;
		close_role = active ? "active" : "passive";
		if (!active) { /* the peer closes first: its close must reach us as EOF */
			struct pollfd pfd = { .fd = c->fd, .events = POLLIN };
			int pr = poll(&pfd, 1, 30000);
			ssize_t r = pr > 0 ? read(c->fd, b, sizeof(b)) : -1;
			eof = pr == 0 ? "timeout" : r == 0 ? "yes" : r > 0 ? "extra-data" : "error";
		}
	}
	close(c->fd);
	c->ok = !err && (!strcmp(close_role, "active") || !strcmp(eof, "yes"));
	c->done = 1;
	double mib = (c->recvd + c->sent) / 2.0 / 1048576.0;
	out("SMCI-CONN case=%s impl=kernel side=%s id=%d ev=end result=%s err=%s at=%s mode=%s fb=0x%08x peer_fb=0x%08x "
	    "sent=%llu recv=%llu want_recv=%llu sha256=%s close=%s eof=%s stall_s=%.3f xfer_s=%.3f mibps=%.1f",
	    case_name, side, c->id, err ? "error" : "ok", errname(err), at, d.mode, d.reason, d.peer,
	    (unsigned long long)c->sent, (unsigned long long)c->recvd, (unsigned long long)c->want_in, sha, close_role, eof,
	    err ? stall : 0.0, xfer, xfer > 0 ? mib / xfer : 0.0);
}

static void *conn_thread(void *p)
{
	run_conn(p);
	return NULL;
}

/* ---------------------------------------------------------------- watchdog */

static struct conn *all_conns;
static int n_conns;
static double deadline_s;

static void *watchdog(void *p)
{
	(void)p;
	while (now() < deadline_s)
		usleep(200000);
	for (int i = 0; i < n_conns; i++) {
		struct conn *c = &all_conns[i];
		if (c->done || c->fd < 0)
			continue;
		out("SMCI-CONN case=%s impl=kernel side=%s id=%d ev=end result=hang sent=%llu recv=%llu want_recv=%llu stall_s=%.3f",
		    case_name, c->server ? "server" : "client", c->id, (unsigned long long)c->sent, (unsigned long long)c->recvd,
		    (unsigned long long)c->want_in, (now_ns() - c->last_ns) / 1e9);
	}
	out("SMCI-PEER case=%s impl=kernel ev=timeout after_s=%.1f", case_name, now() - t_start);
	_exit(3);
}

static void start_watchdog(double timeout)
{
	deadline_s = now() + timeout;
	pthread_t t;
	if (pthread_create(&t, NULL, watchdog, NULL))
		die("pthread_create");
	pthread_detach(t);
}

static void print_lgrs(const char *when)
{
	char s[5400];
	int rc = lgr_summary(s, sizeof(s));
	if (rc)
		out("SMCI-KLGR case=%s when=%s error=%s", case_name, when, strerror(-rc));
	else
		out("SMCI-KLGR case=%s when=%s %s", case_name, when, s);
}

static int family_of(const char *f)
{
	if (!strcmp(f, "smc"))
		return AF_SMC;
	if (!strcmp(f, "tcp"))
		return AF_INET;
	die("bad --family '%s' (smc or tcp)", f);
	return -1;
}

static int cmd_server(int port, int conns, int af, double timeout)
{
	int l = socket(af, SOCK_STREAM | SOCK_CLOEXEC, af == AF_SMC ? SMCPROTO_SMC : 0), one = 1;
	if (l < 0)
		die("socket(%s): %s", af == AF_SMC ? "AF_SMC" : "AF_INET", strerror(errno));
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	if (bind(l, (void *)&a, sizeof(a)) || listen(l, 128))
		die("bind/listen port %d: %s", port, strerror(errno));
	all_conns = calloc(conns, sizeof(struct conn));
	for (int i = 0; i < conns; i++)
		all_conns[i].fd = -1;
	n_conns = conns;
	start_watchdog(timeout);
	print_lgrs("start");
	out("SMCI-PEER case=%s impl=kernel ev=listening port=%d conns=%d", case_name, port, conns);
	for (int i = 0; i < conns; i++) {
		struct conn *c = &all_conns[i];
		double t = now();
		int fd = accept4(l, NULL, NULL, SOCK_CLOEXEC);
		if (fd < 0)
			die("accept: %s", strerror(errno));
		c->server = 1;
		c->t_connect = now() - t;
		c->last_ns = now_ns();
		c->fd = fd;
		if (pthread_create(&c->th, NULL, conn_thread, c))
			die("pthread_create");
		/* The link groups while the peer is surely up: a peer that ends its
		 * group when its process exits (smc-rs does, with DELETE_LINK) can be
		 * gone before the last connection's thread here has joined, so the
		 * dump at the end alone may miss the group the case created. */
		if (i == 0)
			print_lgrs("accept-1");
	}
	close(l);
	int failed = 0;
	for (int i = 0; i < conns; i++) {
		pthread_join(all_conns[i].th, NULL);
		failed += !all_conns[i].ok;
	}
	print_lgrs("end");
	out("SMCI-PEER case=%s impl=kernel ev=exit conns=%d after_s=%.1f", case_name, conns, now() - t_start);
	return failed ? 1 : 0;
}

static int cmd_client(const char *target, const char *rounds, uint64_t bytes, const char *close_mode, int urgent,
		      int af, double timeout, double retry)
{
	char host[64];
	const char *colon = strrchr(target, ':');
	if (!colon || colon == target || (size_t)(colon - target) >= sizeof(host))
		die("bad --connect '%s' (IPv4:PORT)", target);
	memcpy(host, target, colon - target);
	host[colon - target] = 0;
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(parse_num(colon + 1, "port", 1, 65535)) };
	if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
		die("bad address '%s' (IPv4)", host);
	/* rounds: COUNT[xBYTES],... */
	int counts[64];
	uint64_t sizes[64];
	int nr = 0, total = 0;
	char *rs = strdup(rounds);
	for (char *tok = strtok(rs, ","); tok; tok = strtok(NULL, ",")) {
		if (nr == 64)
			die("too many rounds");
		char *x = strchr(tok, 'x');
		if (x)
			*x = 0;
		counts[nr] = parse_num(tok, "round count", 1, 1000);
		sizes[nr] = x ? parse_size(x + 1) : bytes;
		total += counts[nr++];
	}
	free(rs);
	if (!nr)
		die("no rounds");
	all_conns = calloc(total, sizeof(struct conn));
	for (int i = 0; i < total; i++)
		all_conns[i].fd = -1;
	n_conns = total;
	start_watchdog(timeout);
	print_lgrs("start");
	int id = 0;
	for (int r = 0; r < nr; r++) {
		int first = id;
		for (int k = 0; k < counts[r]; k++, id++) {
			struct conn *c = &all_conns[id];
			c->id = id + 1;
			c->want_out = c->want_in = sizes[r];
			c->urgent = urgent;
			c->closer = !strcmp(close_mode, "server") ? CLOSER_SERVER
				    : !strcmp(close_mode, "alt")  ? (c->id % 2 ? CLOSER_CLIENT : CLOSER_SERVER)
								  : CLOSER_CLIENT;
		}
		/* Connect them all, then run them all at once. Handshakes under load would
		 * compete with the data of the round's earlier connections: the kernel gives
		 * an LLC flow (CONFIRM_RKEY of a new buffer) SMC_LLC_WAIT_TIME (2 s), which a
		 * loaded emulated VM can miss (Decline 0x09990003, ERR_REGBUF). */
		for (int i = first; i < id; i++) {
			struct conn *c = &all_conns[i];
			double t0 = now(), give_up = t0 + retry;
			for (;;) {
				int fd = socket(af, SOCK_STREAM | SOCK_CLOEXEC, af == AF_SMC ? SMCPROTO_SMC : 0);
				if (fd < 0)
					die("socket: %s", strerror(errno));
				double t = now();
				if (!connect(fd, (void *)&a, sizeof(a))) {
					c->t_connect = now() - t;
					c->fd = fd;
					break;
				}
				int e = errno;
				close(fd);
				if (e != ECONNREFUSED || now() > give_up) {
					out("SMCI-CONN case=%s impl=kernel side=client id=%d ev=end result=error err=%s at=connect after_s=%.3f",
					    case_name, c->id, errname(e), now() - t0);
					c->done = 1;
					break;
				}
				usleep(200000);
			}
		}
		for (int i = first; i < id; i++) {
			struct conn *c = &all_conns[i];
			c->last_ns = now_ns();
			if (c->fd >= 0 && pthread_create(&c->th, NULL, conn_thread, c))
				die("pthread_create");
		}
		for (int i = first; i < id; i++)
			if (all_conns[i].fd >= 0)
				pthread_join(all_conns[i].th, NULL);
		char when[32];
		snprintf(when, sizeof(when), "round-%d", r + 1);
		print_lgrs(when);
	}
	int failed = 0;
	for (int i = 0; i < total; i++)
		failed += !all_conns[i].ok;
	out("SMCI-PEER case=%s impl=kernel ev=exit conns=%d after_s=%.1f", case_name, total, now() - t_start);
	return failed ? 1 : 0;
}

static int cmd_diag(double wait_empty)
{
	double t0 = now(), give_up = t0 + wait_empty;
	int n;
	for (;;) {
		n = diag_dump(NULL, NULL);
		if (n < 0)
			die("smc_diag: %s (is smc_diag loaded?)", strerror(-n));
		if (n == 0 || now() >= give_up)
			break;
		usleep(250000);
	}
	diag_dump(diag_print_cb, NULL);
	out("SMCI-KDIAG case=%s socks=%d waited_s=%.1f", case_name, n, now() - t0);
	return 0;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: kpeer server --port P --conns N [--family smc|tcp] [--case C] [--timeout S]\n"
		"       kpeer client --connect IP:PORT --rounds COUNT[xBYTES][,..] [--bytes N] [--close client|server|alt] [--urgent]\n"
		"                    [--family smc|tcp] [--case C] [--timeout S] [--retry S]\n"
		"       kpeer gen SEED BYTES | diag [--wait-empty S] | lgr | stats | ueid add NAME|flush|list  [--case C]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	t_start = now();
	signal(SIGPIPE, SIG_IGN);
	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc < 2)
		usage();
	const char *cmd = argv[1];
	if (!strcmp(cmd, "gen")) {
		if (argc != 4)
			usage();
		uint64_t seed = parse_size(argv[2]), n = parse_size(argv[3]);
		static uint8_t b[1 << 16];
		for (uint64_t off = 0; off < n;) {
			size_t k = n - off < sizeof(b) ? n - off : sizeof(b);
			gen_fill(b, k, seed, off);
			if (fwrite(b, 1, k, stdout) != k)
				return 1;
			off += k;
		}
		return 0;
	}
	/* options after the command */
	int port = 0, conns = 1, af = AF_SMC, urgent = 0;
	double timeout = 600, retry = 60, wait_empty = 0;
	const char *target = NULL, *rounds = "1", *close_mode = "client";
	uint64_t bytes = 1 << 20;
	int posc = 0;
	char *pos[8];
	for (int i = 2; i < argc; i++) {
		const char *o = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(o, name) && (v || (die("%s needs a value", name), 0)) && ++i)
		if (OPT("--port"))
			port = parse_num(v, "port", 1, 65535);
		else if (OPT("--conns"))
			conns = parse_num(v, "conns", 1, 10000);
		else if (OPT("--family"))
			af = family_of(v);
		else if (OPT("--case"))
			case_name = v;
		else if (OPT("--timeout"))
			timeout = parse_num(v, "timeout", 1, 86400);
		else if (OPT("--retry"))
			retry = parse_num(v, "retry", 0, 3600);
		else if (OPT("--connect"))
			target = v;
		else if (OPT("--rounds"))
			rounds = v;
		else if (OPT("--bytes"))
			bytes = parse_size(v);
		else if (OPT("--close")) {
			if (strcmp(v, "client") && strcmp(v, "server") && strcmp(v, "alt"))
				die("bad --close '%s' (client, server or alt)", v);
			close_mode = v;
		} else if (OPT("--wait-empty"))
			wait_empty = parse_num(v, "wait-empty", 0, 3600);
		else if (!strcmp(o, "--urgent"))
			urgent = 1;
		else if (o[0] == '-' && o[1] == '-')
			die("unknown option %s", o);
		else if (posc < 8)
			pos[posc++] = argv[i];
		else
			usage();
#undef OPT
	}
	if (!strcmp(cmd, "server")) {
		if (!port)
			die("server needs --port");
		return cmd_server(port, conns, af, timeout);
	}
	if (!strcmp(cmd, "client")) {
		if (!target)
			die("client needs --connect IP:PORT");
		return cmd_client(target, rounds, bytes, close_mode, urgent, af, timeout, retry);
	}
	if (!strcmp(cmd, "diag"))
		return cmd_diag(wait_empty);
	if (!strcmp(cmd, "lgr") || !strcmp(cmd, "stats")) {
		char *a[] = { (char *)cmd };
		return cmd_genl(1, a);
	}
	if (!strcmp(cmd, "ueid")) {
		char *a[4] = { "ueid", posc > 0 ? pos[0] : NULL, posc > 1 ? pos[1] : NULL, NULL };
		if (!a[1])
			usage();
		return cmd_genl(posc + 1, a);
	}
	usage();
	return 2;
}
