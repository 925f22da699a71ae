#!/bin/sh
# Build and run the transport harness (no Python needed).
set -e
here=$(dirname "$0")
root=$here/../..
out=${TMPDIR:-/tmp}/ra_comm_harness
cc -O1 -g -Wall -Wextra -pthread -o "$out" "$here/comm_harness.c" \
   "$root/csrc/comm_core.c" "$root/csrc/comm_host.c" \
   "$root/csrc/comm_host_boot.c" \
   "$root/csrc/comm_threads.c" "$root/csrc/comm_auth.c" \
   "$root/csrc/status.c" "$root/csrc/alloc.c" -lm
exec "$out"
