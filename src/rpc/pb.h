/*
 * pb.h: the protobuf-c allocator every libstepguard message codec uses, so
 * that decoding a peer's message goes through sg_malloc (and its failure
 * injection) like every other allocation.
 */
#ifndef SG_RPC_PB_H
#define SG_RPC_PB_H

#include <protobuf-c/protobuf-c.h>

extern ProtobufCAllocator sg__pb_allocator;

#endif /* SG_RPC_PB_H */
