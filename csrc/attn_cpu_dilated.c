/* placeholder, replaced below */
#include "attn_cpu.h"
#include "attn_cpu_kern.h"
ra_status ra_cpu_dilated_fwd(const ra_attn_fwd_params *p, const ra_dilated_config *cfg) {
    (void)p; (void)cfg; ra_set_error(RA_ERR_UNSUPPORTED, "dilated: not yet"); return RA_ERR_UNSUPPORTED; }
ra_status ra_cpu_dilated_bwd(const ra_attn_bwd_params *p, const ra_dilated_config *cfg) {
    (void)p; (void)cfg; ra_set_error(RA_ERR_UNSUPPORTED, "dilated: not yet"); return RA_ERR_UNSUPPORTED; }
