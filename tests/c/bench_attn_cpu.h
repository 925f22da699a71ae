/*
 * bench_attn_cpu.h -- timing mode of test_attn_cpu (included by it):
 * float32 forward and backward of B=1, H=8, D=64 (or argv) for S in
 * {1024, 4096, 8192}, causal and not, with the thread count of
 * RINGATTN_NUM_THREADS.  Reports GFLOP/s counting 4 B H S^2 D for the
 * forward (halved when causal) and 2.5x that for the backward.
 */
static double bench_best(ra_status (*fn)(const void *), const void *arg, int reps) {
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = ra_now();
        if (fn(arg) != RA_OK) { printf("error: %s\n", ra_last_error()); return -1; }
        double t = ra_now() - t0;
        if (t < best) best = t;
    }
    return best;
}
static ra_status bench_fwd(const void *a) { return ra_cpu_attn_fwd((const ra_attn_fwd_params *)a); }
static ra_status bench_bwd(const void *a) { return ra_cpu_attn_bwd((const ra_attn_bwd_params *)a); }

static int bench_main(int argc, char **argv) {
    int64_t Sonly = argc > 2 ? atoll(argv[2]) : 0;
    const int64_t B = 1, H = 8, D = argc > 3 ? atoll(argv[3]) : 64;
    const int64_t Ss[3] = {1024, 4096, 8192};
    printf("SIMD %s threads %d  B=%lld H=%lld D=%lld float32\n", ra_cpu_simd_level(),
           ra_cpu_num_threads(0), (long long)B, (long long)H, (long long)D);
    printf("%6s %6s %10s %10s %10s %10s\n", "S", "causal", "fwd ms", "fwd GF/s", "bwd ms", "bwd GF/s");
    for (int si = 0; si < 3; si++) {
        int64_t S = Sonly ? Sonly : Ss[si];
        if (Sonly && si) break;
        size_t n = (size_t)(B * S * H * D);
        float *q = malloc(n * 4), *k = malloc(n * 4), *v = malloc(n * 4), *o = malloc(n * 4);
        float *dout = malloc(n * 4), *dq = malloc(n * 4), *dk = malloc(n * 4), *dv = malloc(n * 4);
        float *lse = malloc((size_t)(B * H * S) * 4), *delta = malloc((size_t)(B * H * S) * 4);
        for (size_t i = 0; i < n; i++) { q[i] = (float)urand(); k[i] = (float)urand(); v[i] = (float)urand(); dout[i] = (float)urand(); }
        for (int causal = 0; causal < 2; causal++) {
            ra_attn_fwd_params fp = {0};
            fp.q = q; fp.k = k; fp.v = v; fp.out = o; fp.lse = lse;
            fp.dtype = fp.out_dtype = RA_FLOAT32;
            fp.batch = B; fp.seqlen_q = fp.seqlen_k = S; fp.heads = fp.heads_kv = H; fp.head_dim = D;
            fp.q_batch_stride = fp.k_batch_stride = fp.v_batch_stride = fp.out_batch_stride = S * H * D;
            fp.q_seq_stride = fp.k_seq_stride = fp.v_seq_stride = fp.out_seq_stride = H * D;
            fp.q_head_stride = fp.k_head_stride = fp.v_head_stride = fp.out_head_stride = D;
            fp.lse_batch_stride = H * S; fp.lse_head_stride = S; fp.lse_seq_stride = 1;
            fp.scale = 1.0 / sqrt((double)D); fp.causal = causal;
            fp.q_pos_stride = fp.k_pos_stride = 1;
            ra_attn_bwd_params bp = {0};
            bp.q = q; bp.k = k; bp.v = v; bp.out = o; bp.dout = dout; bp.lse = lse; bp.delta = delta;
            bp.dq = dq; bp.dk = dk; bp.dv = dv;
            bp.dtype = bp.out_dtype = bp.grad_dtype = RA_FLOAT32;
            bp.batch = B; bp.seqlen_q = bp.seqlen_k = S; bp.heads = bp.heads_kv = H; bp.head_dim = D;
            bp.q_batch_stride = bp.k_batch_stride = bp.v_batch_stride = bp.out_batch_stride = S * H * D;
            bp.dout_batch_stride = bp.dq_batch_stride = bp.dk_batch_stride = bp.dv_batch_stride = S * H * D;
            bp.q_seq_stride = bp.k_seq_stride = bp.v_seq_stride = bp.out_seq_stride = H * D;
            bp.dout_seq_stride = bp.dq_seq_stride = bp.dk_seq_stride = bp.dv_seq_stride = H * D;
            bp.q_head_stride = bp.k_head_stride = bp.v_head_stride = bp.out_head_stride = D;
            bp.dout_head_stride = bp.dq_head_stride = bp.dk_head_stride = bp.dv_head_stride = D;
            bp.lse_batch_stride = H * S; bp.lse_head_stride = S; bp.lse_seq_stride = 1;
            bp.scale = fp.scale; bp.causal = causal; bp.q_pos_stride = bp.k_pos_stride = 1;
            int reps = S <= 1024 ? 5 : (S <= 4096 ? 3 : 2);
            double tf = bench_best(bench_fwd, &fp, reps);
            ra_cpu_attn_bwd_preprocess(&bp);
            double tb = bench_best(bench_bwd, &bp, reps);
            double fl = 4.0 * B * H * (double)S * S * D * (causal ? 0.5 : 1.0);
            printf("%6lld %6d %10.2f %10.1f %10.2f %10.1f\n", (long long)S, causal, tf * 1e3,
                   fl / tf * 1e-9, tb * 1e3, 2.5 * fl / tb * 1e-9);
            fflush(stdout);
        }
        free(q); free(k); free(v); free(o); free(dout); free(dq); free(dk); free(dv); free(lse); free(delta);
    }
    return 0;
}
