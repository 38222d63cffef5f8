/* pb.c: see pb.h. */
#include "rpc/pb.h"

#include "stepguard/base.h"

static void *pb_alloc(void *ud, size_t n) {
  (void)ud;
  return sg_malloc(n);
}

static void pb_free(void *ud, void *p) {
  (void)ud;
  sg_free(p);
}

ProtobufCAllocator sg__pb_allocator = {pb_alloc, pb_free, NULL};
