/*
 * attn_cpu_mask.c -- the masks of ra_attn_mask (DESIGN 2, "Masks") as the
 * CPU tile kernels read them (ra_tile_mask, attn_cpu_kern.h):
 *
 *   causal and window -> the bounds of the key positions a query sees,
 *     [qp - lo_off, qp + hi_off], so that a tile kernel finds the keys of a
 *     query block (and the queries of a key block) with a few divisions and
 *     skips everything outside them: a sliding window costs O(n w);
 *   documents -> contiguous int32 copies of the ids, whether each batch row
 *     is sorted (packed documents: a document's rows are then found by
 *     binary search, so the work is O(sum of squared document lengths)),
 *     and the id range of every key block, so that blocks of other
 *     documents are skipped without looking at their keys.
 */
#include "attn/attn_cpu.h"
#include "attn/attn_cpu_kern.h"

void ra_cpu_tile_mask(int causal, const ra_attn_mask *mask, ra_tile_mask *m) {
    memset(m, 0, sizeof *m);
    if (mask->has_window && mask->window_left >= 0) {
        m->has_lo = 1;
        m->lo_off = mask->window_left;
    }
    if (causal) {              /* pos_k <= pos_q, whatever the window says */
        m->has_hi = 1;
        m->hi_off = 0;
    } else if (mask->has_window && mask->window_right >= 0) {
        m->has_hi = 1;
        m->hi_off = mask->window_right;
    }
    if (mask->softcap > 0) m->softcap2 = mask->softcap * RA_LOG2E;
}

/* strided int32 (B, S) -> contiguous, and whether each row is sorted */
static void copy_ids(const int32_t *src, int64_t bs, int64_t ss, int64_t B,
                     int64_t S, int32_t *dst, int32_t *sorted) {
    for (int64_t b = 0; b < B; b++) {
        int32_t *row = dst + b * S;
        int ok = 1;
        for (int64_t i = 0; i < S; i++) {
            row[i] = src[b * bs + i * ss];
            if (i > 0 && row[i] < row[i - 1]) ok = 0;
        }
        sorted[b] = ok;
    }
}

ra_status ra_cpu_ids_prepare(const ra_attn_mask *mask, int64_t B, int64_t Sq,
                             int64_t Sk, ra_cpu_ids *ids) {
    memset(ids, 0, sizeof *ids);
    if (mask->q_segment_ids == NULL) return RA_OK;
    const int64_t nkb = ra_cpu_cdiv(Sk, RA_CPU_BK);
    /* q, kv, kv_min, kv_max, q_sorted, kv_sorted */
    int64_t n = 0;
    if (!ra_mul_ok(B, Sq + Sk + 2 * nkb + 2, &n) || n > (INT64_MAX >> 3)) {
        ra_set_error(RA_ERR_OVERFLOW, "attention: segment id scratch overflows");
        return RA_ERR_OVERFLOW;
    }
    ids->bytes = (size_t)(n > 0 ? n : 1) * sizeof(int32_t);
    int32_t *all = (int32_t *)ra_host_alloc(ids->bytes);
    if (all == NULL) return RA_ERR_NOMEM;
    ids->q = all;
    ids->kv = ids->q + B * Sq;
    ids->kv_min = ids->kv + B * Sk;
    ids->kv_max = ids->kv_min + B * nkb;
    ids->q_sorted = ids->kv_max + B * nkb;
    ids->kv_sorted = ids->q_sorted + B;
    ids->nkb = nkb;
    copy_ids(mask->q_segment_ids, mask->q_seg_batch_stride,
             mask->q_seg_seq_stride, B, Sq, ids->q, ids->q_sorted);
    copy_ids(mask->kv_segment_ids, mask->kv_seg_batch_stride,
             mask->kv_seg_seq_stride, B, Sk, ids->kv, ids->kv_sorted);
    for (int64_t b = 0; b < B; b++)
        for (int64_t kb = 0; kb < nkb; kb++) {
            const int64_t j0 = kb * RA_CPU_BK;
            const int64_t nj = Sk - j0 < RA_CPU_BK ? Sk - j0 : RA_CPU_BK;
            ra_ids_range(ids->kv + b * Sk + j0, nj, ids->kv_sorted[b],
                         &ids->kv_min[b * nkb + kb], &ids->kv_max[b * nkb + kb]);
        }
    return RA_OK;
}

void ra_cpu_ids_free(ra_cpu_ids *ids) {
    if (ids->q != NULL) ra_host_free(ids->q, ids->bytes);
    memset(ids, 0, sizeof *ids);
}

void ra_cpu_tile_ids(const ra_cpu_ids *ids, int64_t b, int64_t Sq, int64_t Sk,
                     int64_t i0, int64_t j0, ra_tile_mask *m) {
    if (ids->q == NULL) return;
    m->q_ids = ids->q + b * Sq + i0;
    m->kv_ids = ids->kv + b * Sk + j0;
    m->kv_block_min = ids->kv_min + b * ids->nkb;
    m->kv_block_max = ids->kv_max + b * ids->nkb;
    m->q_sorted = ids->q_sorted[b];
    m->kv_sorted = ids->kv_sorted[b];
}
