/*
 * addr.c: the library's one "host:port" parser and the one rule for the
 * host a process advertises.  See stepguard/base.h.
 */
#include "stepguard/base.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int bad(sg_err_t *err, const char *addr, const char *why) {
  return sg_err_set(err, SG_EINVAL, "address \"%.64s\": %s", addr ? addr : "",
                    why);
}

int sg_addr_split(const char *addr, char *host, size_t hostcap, int *port,
                  sg_err_t *err) {
  size_t len = addr ? strnlen(addr, SG_ADDR_MAX + 1) : 0;
  if (len == 0)
    return bad(err, addr, "empty");
  if (len > SG_ADDR_MAX)
    return bad(err, addr, "too long");
  const char *hs, *he, *colon;
  if (addr[0] == '[') {
    hs = addr + 1;
    he = memchr(addr, ']', len);
    if (!he || he + 1 >= addr + len || he[1] != ':')
      return bad(err, addr, "expected [address]:port");
    colon = he + 1;
  } else {
    hs = addr;
    colon = memchr(addr, ':', len);
    if (!colon)
      return bad(err, addr, "missing :port");
    if (memchr(colon + 1, ':', len - (size_t)(colon + 1 - addr)))
      return bad(err, addr, "an IPv6 address needs [brackets]");
    he = colon;
  }
  if (he == hs)
    return bad(err, addr, "empty host");
  for (const char *q = hs; q < he; q++)
    if ((unsigned char)*q <= 0x20 || (unsigned char)*q > 0x7e || *q == '[' ||
        *q == ']' || *q == '/')
      return bad(err, addr, "bad character in host");
  const char *ps = colon + 1, *pe = addr + len;
  if (ps == pe || pe - ps > 5)
    return bad(err, addr, "bad port");
  int v = 0;
  for (const char *q = ps; q < pe; q++) {
    if (*q < '0' || *q > '9')
      return bad(err, addr, "bad port");
    v = v * 10 + (*q - '0');
  }
  if (v > 65535)
    return bad(err, addr, "port out of range");
  size_t hl = (size_t)(he - hs);
  if (hl + 1 > hostcap)
    return bad(err, addr, "host too long");
  memcpy(host, hs, hl);
  host[hl] = '\0';
  *port = v;
  return 0;
}

/* interface_addr: the first IPv4 (else IPv6) address of interface `name`
 * as a URL host ("10.0.0.2", "[fe80::1]"); 0 on success. */
static int interface_addr(const char *name, char *host, size_t cap) {
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs) != 0)
    return -1;
  int found = 0;
  for (int want = AF_INET; !found && want;
       want = want == AF_INET ? AF_INET6 : 0)
    for (struct ifaddrs *i = ifs; !found && i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != want ||
          strcmp(i->ifa_name, name) != 0)
        continue;
      char buf[INET6_ADDRSTRLEN];
      const void *a =
          want == AF_INET
              ? (const void *)&((struct sockaddr_in *)i->ifa_addr)->sin_addr
              : (const void *)&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr;
      if (!inet_ntop(want, a, buf, sizeof(buf)))
        continue;
      snprintf(host, cap, want == AF_INET ? "%s" : "[%s]", buf);
      found = 1;
    }
  freeifaddrs(ifs);
  return found ? 0 : -1;
}

void sg_addr_advertised(const char *option, const char *fallback, char *host,
                        size_t cap) {
  if (cap == 0)
    return;
  const char *name = getenv("STEPGUARD_ADVERTISE_HOST");
  if (!name || !name[0])
    name = option;
  if (!name || !name[0])
    name = fallback;
  if (name && name[0]) {
    if (if_nametoindex(name) && interface_addr(name, host, cap) == 0)
      ; /* an interface: its address */
    else if (strchr(name, ':') && name[0] != '[')
      snprintf(host, cap, "[%s]", name); /* a bare IPv6 literal */
    else
      snprintf(host, cap, "%s", name);
  } else if (gethostname(host, cap) != 0) {
    snprintf(host, cap, "localhost");
  }
  host[cap - 1] = '\0';
}
