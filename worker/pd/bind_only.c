/* bind() that turns a wildcard TCP address into one chosen address, while asked to.
 *
 * Preloaded (LD_PRELOAD) into a prefill/decode stage actor, so that the Mooncake transfer
 * engine, which binds its listeners to every interface whatever address it is given, binds them
 * to the node's address instead. Inert until dsv4ray_bind_only(host) is called; the stage calls
 * it around the engine's start and clears it after (NULL), so no other bind of the process is
 * touched. Only SOCK_STREAM sockets bound to 0.0.0.0 or [::] are rewritten: an AF_INET6 socket
 * gets the v4-mapped address (::ffff:host); where the kernel refuses that (an IPV6_V6ONLY
 * socket) the original wildcard bind goes ahead and the caller sees it still listening on all
 * interfaces.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static struct in_addr only_addr; /* network order; valid while active */
static int active;               /* read and written atomically */

/* Rewrites wildcard binds to host (dotted IPv4) from now on; NULL stops. 0, or -1 for a host
 * that is not an IPv4 address. */
int dsv4ray_bind_only(const char *host) {
    if (host == NULL) {
        __atomic_store_n(&active, 0, __ATOMIC_RELEASE);
        return 0;
    }
    struct in_addr parsed;
    if (inet_pton(AF_INET, host, &parsed) != 1) return -1;
    only_addr = parsed;
    __atomic_store_n(&active, 1, __ATOMIC_RELEASE);
    return 0;
}

static int is_stream(int fd) {
    int type = 0;
    socklen_t size = sizeof type;
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) == 0 && type == SOCK_STREAM;
}

/* The address to bind instead of addr (into out), or 0 to bind addr as given. */
static socklen_t narrowed(const struct sockaddr *addr, socklen_t len,
                          struct sockaddr_storage *out) {
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in v4;
        memcpy(&v4, addr, sizeof v4);
        if (v4.sin_addr.s_addr != htonl(INADDR_ANY)) return 0;
        v4.sin_addr = only_addr;
        memcpy(out, &v4, sizeof v4);
        return sizeof v4;
    }
    if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 v6;
        memcpy(&v6, addr, sizeof v6);
        if (!IN6_IS_ADDR_UNSPECIFIED(&v6.sin6_addr)) return 0;
        memset(&v6.sin6_addr, 0, sizeof v6.sin6_addr); /* ::ffff:a.b.c.d */
        v6.sin6_addr.s6_addr[10] = 0xff;
        v6.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&v6.sin6_addr.s6_addr[12], &only_addr, 4);
        memcpy(out, &v6, sizeof v6);
        return sizeof v6;
    }
    return 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real;
    if (real == NULL) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr != NULL && __atomic_load_n(&active, __ATOMIC_ACQUIRE) && is_stream(fd)) {
        struct sockaddr_storage moved;
        socklen_t moved_len = narrowed(addr, len, &moved);
        if (moved_len != 0) {
            int saved = errno;
            if (real(fd, (struct sockaddr *)&moved, moved_len) == 0) return 0;
            errno = saved; /* refused (a v6-only socket): bind as asked */
        }
    }
    return real(fd, addr, len);
}
