/*
 * attn_params.c -- what every entry point does to the kernel params
 * before a kernel trusts them (attn_params.h): the position bounds.
 * Python-free: the CPython entry points (attn_api*.c) and the XLA
 * handlers (csrc/xla/) call the same functions.
 */
#include "attn/attn_params.h"

ra_status ra_check_positions(const char *offset_name, int64_t offset,
                             const char *stride_name, int64_t stride,
                             int64_t len) {
    int64_t span = 0, reach = 0;
    if (stride < 1) {
        ra_set_error(RA_ERR_VALUE, "%s: expected >= 1, got %lld", stride_name,
                     (long long)stride);
        return RA_ERR_VALUE;
    }
    /* |offset| is taken only once offset is known to be in range */
    if (len < 0 || offset <= -RA_POS_LIMIT || offset >= RA_POS_LIMIT ||
        __builtin_mul_overflow(stride, len, &span) ||
        __builtin_add_overflow(offset < 0 ? -offset : offset, span, &reach) ||
        reach >= RA_POS_LIMIT) {
        ra_set_error(RA_ERR_VALUE,
                     "%s, %s: expected |offset| + stride * rows < 2^60 "
                     "(positions stay inside +-2^60), got offset %lld, "
                     "stride %lld, %lld rows",
                     offset_name, stride_name, (long long)offset,
                     (long long)stride, (long long)len);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}
