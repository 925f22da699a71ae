#!/bin/sh
# Build and run the transport harness (no Python needed).
set -e
here=$(dirname "$0")
root=$here/../..
out=${TMPDIR:-/tmp}/ra_comm_harness
cc -O1 -g -Wall -Wextra -pthread -I"$root/csrc" -o "$out" "$here/comm_harness.c" \
   "$root/csrc/comm/comm_core.c" "$root/csrc/comm/comm_split.c" \
   "$root/csrc/comm/comm_host.c" "$root/csrc/comm/comm_host_engine.c" \
   "$root/csrc/comm/comm_host_match.c" "$root/csrc/comm/comm_host_split.c" \
   "$root/csrc/comm/comm_host_boot.c" \
   "$root/csrc/comm/comm_threads.c" "$root/csrc/comm/comm_threads_split.c" \
   "$root/csrc/comm/comm_threads_cuda.c" \
   "$root/csrc/comm/comm_auth.c" \
   "$root/csrc/comm/comm_nccl.c" "$root/csrc/comm/nccl_loader.c" \
   "$root/csrc/core/status.c" "$root/csrc/core/alloc.c" -lm
exec "$out"
