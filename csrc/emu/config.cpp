/*
 * config.cpp -- the emulated GPU's settings (RINGATTN_EMU_*, read once) and
 * its reports (what the checker and the SIMT layer find).
 */
#include "emu/emu.h"

#include <ctype.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <string>

namespace {

ra_emu_settings g_settings;
pthread_once_t g_once = PTHREAD_ONCE_INIT;

long env_long(const char *name, long def, long lo, long hi) {
    const char *s = getenv(name);
    if (s == NULL || *s == '\0') return def;
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "ringattn emulated GPU: ignoring %s=%s (expected an integer in "
                "[%ld, %ld])\n", name, s, lo, hi);
        return def;
    }
    return v;
}

size_t env_bytes(const char *name, size_t def) {
    const char *s = getenv(name);
    if (s == NULL || *s == '\0') return def;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned long long mul = 1;
    if (end != s) {
        switch (toupper((unsigned char)*end)) {
        case 'K': mul = 1ull << 10; end++; break;
        case 'M': mul = 1ull << 20; end++; break;
        case 'G': mul = 1ull << 30; end++; break;
        default: break;
        }
    }
    if (end == s || *end != '\0' || v == 0 || v > (1ull << 40) / mul) {
        fprintf(stderr, "ringattn emulated GPU: ignoring %s=%s (expected bytes, "
                "e.g. 4G)\n", name, s);
        return def;
    }
    return (size_t)(v * mul);
}

void read_settings() {
    ra_emu_settings &c = g_settings;
    c.devices = (int)env_long("RINGATTN_EMU_DEVICES", 2, 1, RA_EMU_MAX_DEVICES);
    c.mem_bytes = env_bytes("RINGATTN_EMU_MEMORY", (size_t)16 << 30);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    c.workers = (int)env_long("RINGATTN_EMU_WORKERS", ncpu > 0 ? ncpu : 1, 1, 256);
    c.check = (int)env_long("RINGATTN_EMU_CHECK", 1, 0, 1);
    const char *sch = getenv("RINGATTN_EMU_SCHEDULE");
    c.schedule = 0;
    if (sch != NULL && *sch != '\0') {
        if (strcmp(sch, "forward") == 0) c.schedule = 0;
        else if (strcmp(sch, "reverse") == 0) c.schedule = 1;
        else if (strcmp(sch, "random") == 0) c.schedule = 2;
        else
            fprintf(stderr, "ringattn emulated GPU: ignoring RINGATTN_EMU_SCHEDULE=%s "
                    "(expected forward, reverse or random)\n", sch);
    }
    c.seed = (uint64_t)env_long("RINGATTN_EMU_SEED", 1, 0, 0x7fffffffffffffffL);
    c.lazy = (int)env_long("RINGATTN_EMU_LAZY", 0, 0, 1);
    c.quiet = (int)env_long("RINGATTN_EMU_QUIET", 0, 0, 1);
    c.peer = (int)env_long("RINGATTN_EMU_PEER", 1, 0, 1);
}

/* every report of the process, newest last (bounded: the first 200 kept
 * whole, then only counted) */
pthread_mutex_t g_report_mu = PTHREAD_MUTEX_INITIALIZER;
std::string *g_reports;  // leaked on purpose: read at any time, even at exit
long g_report_count;
int g_report_kept;

}  // namespace

extern "C" const ra_emu_settings *ra_emu_config(void) {
    pthread_once(&g_once, read_settings);
    return &g_settings;
}

/* The SIMT layer's per-thread context adds the kernel, block and thread;
 * defined in simt.cpp (weak here so the runtime links without it). */
extern "C" __attribute__((weak)) int ra_emu_report_context(char *buf, size_t n);
extern "C" __attribute__((weak)) void ra_emu_report_fail_current(ra_emu_report_kind kind,
                                                                const char *text);

extern "C" void ra_emu_report(ra_emu_report_kind kind, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char ctx[512] = "";
    if (ra_emu_report_context != NULL) ra_emu_report_context(ctx, sizeof ctx);
    char text[1600];
    snprintf(text, sizeof text, "%s%s%s", msg, ctx[0] ? " " : "", ctx);
    pthread_mutex_lock(&g_report_mu);
    if (g_reports == NULL) g_reports = new std::string();
    g_report_count++;
    if (g_report_kept < 200) {
        g_report_kept++;
        *g_reports += text;
        *g_reports += '\n';
    }
    pthread_mutex_unlock(&g_report_mu);
    if (!ra_emu_config()->quiet) fprintf(stderr, "ringattn emulated GPU: %s\n", text);
    if (ra_emu_report_fail_current != NULL) ra_emu_report_fail_current(kind, text);
}

extern "C" const char *ra_emu_reports_text(void) {
    /* a copy taken under the lock, owned by the calling thread: stable
     * until this thread's next call, whatever other threads report */
    static thread_local std::string snapshot;
    pthread_mutex_lock(&g_report_mu);
    if (g_reports == NULL) g_reports = new std::string();
    snapshot = *g_reports;
    pthread_mutex_unlock(&g_report_mu);
    return snapshot.c_str();
}

extern "C" long ra_emu_reports_count(void) {
    pthread_mutex_lock(&g_report_mu);
    long n = g_report_count;
    pthread_mutex_unlock(&g_report_mu);
    return n;
}

extern "C" void ra_emu_reports_clear(void) {
    pthread_mutex_lock(&g_report_mu);
    if (g_reports != NULL) g_reports->clear();
    g_report_count = 0;
    g_report_kept = 0;
    pthread_mutex_unlock(&g_report_mu);
}
