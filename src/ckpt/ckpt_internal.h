/*
 * ckpt_internal.h: what the files of src/ckpt share and nothing else does.
 */
#ifndef SG_CKPT_INTERNAL_H
#define SG_CKPT_INTERNAL_H

#include "stepguard/base.h"
#include "stepguard/ckpt.h"

/* Little-endian u64 load and store. */
uint64_t sg__ckpt_get64(const uint8_t *p);
void sg__ckpt_put64(uint8_t *p, uint64_t v);

/*
 * sg__ckpt_find: the index of the region holding byte `off` of the
 * concatenation, given `prefix` (n + 1 entries, prefix[i] = bytes before
 * region i); n when off == prefix[n].  Zero-length regions are skipped.
 */
size_t sg__ckpt_find(const uint64_t *prefix, size_t n, uint64_t off);

#endif
