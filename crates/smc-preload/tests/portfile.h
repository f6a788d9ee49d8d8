/* What the servers of the preload's C test programs (fdlimit.c, unsent.c,
 * waiting.c) share: a listening socket whose port they tell the test in a
 * file. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

/* A TCP socket listening on `addr` (host order: INADDR_LOOPBACK,
 * INADDR_ANY), port 0, with `backlog`; its port written to `portfile`
 * once it listens. -1 (errno set) if any step failed. */
static int listen_to_portfile(const char *portfile, in_addr_t addr, int backlog) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0)
        return -1;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(addr) };
    socklen_t al = sizeof a;
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, backlog) ||
        getsockname(l, (struct sockaddr *)&a, &al)) {
        close(l);
        return -1;
    }
    FILE *f = fopen(portfile, "w");
    if (!f) {
        close(l);
        return -1;
    }
    fprintf(f, "%d\n", ntohs(a.sin_port));
    fclose(f);
    return l;
}
