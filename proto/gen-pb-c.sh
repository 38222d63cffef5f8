#!/bin/sh
# gen-pb-c.sh PROTOC_C PROTO_INCLUDE SRCDIR OUTDIR
# Runs protoc-c on torchft.proto and the system timestamp.proto and writes
# the four generated files flat into OUTDIR, so meson can name them.
set -eu
protoc_c=$1 inc=$2 src=$3 out=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$protoc_c" --proto_path="$inc" --c_out="$tmp" "$inc/google/protobuf/timestamp.proto"
"$protoc_c" --proto_path="$src" --proto_path="$inc" --c_out="$tmp" "$src/torchft.proto"
sed 's|#include "google/protobuf/timestamp.pb-c.h"|#include "timestamp.pb-c.h"|' \
  "$tmp/google/protobuf/timestamp.pb-c.c" >"$out/timestamp.pb-c.c"
cp "$tmp/google/protobuf/timestamp.pb-c.h" "$out/timestamp.pb-c.h"
sed 's|#include "google/protobuf/timestamp.pb-c.h"|#include "timestamp.pb-c.h"|' \
  "$tmp/torchft.pb-c.h" >"$out/torchft.pb-c.h"
cp "$tmp/torchft.pb-c.c" "$out/torchft.pb-c.c"
