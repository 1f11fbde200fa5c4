/*
 * A pass-through libcuda.so.1 for the GPU machine: every export jumps to NVIDIA's driver (stubs.S from
 * gen.sh), and the slots of the export tables named in SPY_TABLES are wrapped so that each call is logged
 * (table, slot, caller library, six integer arguments and the words they point at, before and after,
 * and the result). What cuBLAS, cuBLASLt and cuDNN do with the driver's private tables, measured.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "names.h"

#define NSYMS (sizeof SPY_NAMES / sizeof SPY_NAMES[0])
__attribute__((visibility("hidden"))) void *spy_ptrs[NSYMS];

typedef int CUresult;
typedef CUresult (*export_fn)(const void **, const void *);
typedef CUresult (*proc_v2_fn)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*proc_v1_fn)(const char *, void **, int, unsigned long long);

static void *real;
static void *self_handle;
static export_fn real_export;
static proc_v2_fn real_proc_v2;
static proc_v1_fn real_proc_v1;
static FILE *logf_;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

#define MAX_TABLES 8
#define MAX_SLOTS 128
static unsigned char spy_ids[MAX_TABLES][16];
static uintptr_t originals[MAX_TABLES][MAX_SLOTS];
static uintptr_t copies[MAX_TABLES][MAX_SLOTS];
static int ntables;
static int calls[MAX_TABLES][MAX_SLOTS];

static const char *lib_of(const void *addr) {
    Dl_info info;
    if (addr && dladdr(addr, &info) && info.dli_fname) {
        const char *s = strrchr(info.dli_fname, '/');
        return s ? s + 1 : info.dli_fname;
    }
    return "?";
}

static int peek(uintptr_t addr, uintptr_t out[2]) {
    struct iovec local = {out, 2 * sizeof(uintptr_t)}, remote = {(void *)addr, 2 * sizeof(uintptr_t)};
    if (addr < 4096) return 0;
    return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == (ssize_t)(2 * sizeof(uintptr_t));
}

static void hexid(const unsigned char *id, char *s) {
    for (int i = 0; i < 16; i++) sprintf(s + 2 * i, "%02x", id[i]);
}

extern unsigned spy_seq[];
extern unsigned long spy_nseq;
void spy_note(unsigned i);
#define NOTE_SLOT 100000u  /* + table * 1000 + slot */
#define NOTE_EXPORT 200000u
#define NOTE_PROC 200001u

static uintptr_t spy_call(int t, int s, const void *ret, uintptr_t a[6]) {
    spy_note(NOTE_SLOT + (unsigned)t * 1000u + (unsigned)s);
    typedef uintptr_t (*fn6)(uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t);
    int n = __atomic_add_fetch(&calls[t][s], 1, __ATOMIC_RELAXED);
    int logit = n <= 40 && logf_;
    char id[33];
    hexid(spy_ids[t], id);
    if (logit) {
        pthread_mutex_lock(&lock);
        fprintf(logf_, "call %.8s slot %d #%d from %s+%#lx\n", id, s, n, lib_of(ret),
                (unsigned long)((uintptr_t)ret - (uintptr_t)({ Dl_info i_; dladdr(ret, &i_) ? (uintptr_t)i_.dli_fbase : 0; })));
        for (int k = 0; k < 6; k++) {
            uintptr_t w[2];
            if (peek(a[k], w))
                fprintf(logf_, "  in  a%d=%#lx -> [%#lx %#lx]\n", k, (unsigned long)a[k], (unsigned long)w[0], (unsigned long)w[1]);
            else
                fprintf(logf_, "  in  a%d=%#lx\n", k, (unsigned long)a[k]);
        }
        pthread_mutex_unlock(&lock);
    }
    uintptr_t r = ((fn6)originals[t][s])(a[0], a[1], a[2], a[3], a[4], a[5]);
    if (logit) {
        pthread_mutex_lock(&lock);
        fprintf(logf_, "  ret %#lx (%ld)\n", (unsigned long)r, (long)(int)r);
        for (int k = 0; k < 6; k++) {
            uintptr_t w[2];
            if (peek(a[k], w))
                fprintf(logf_, "  out a%d -> [%#lx %#lx] %s\n", k, (unsigned long)w[0], (unsigned long)w[1], lib_of((void *)w[0]));
        }
        fflush(logf_);
        pthread_mutex_unlock(&lock);
    }
    return r;
}

#define TR(t, s)                                                                                         \
    static uintptr_t tr_##t##_##s(uintptr_t a0, uintptr_t a1, uintptr_t a2, uintptr_t a3, uintptr_t a4,   \
                                  uintptr_t a5) {                                                        \
        uintptr_t a[6] = {a0, a1, a2, a3, a4, a5};                                                       \
        return spy_call(t, s, __builtin_return_address(0), a);                                           \
    }
#define L(t, s) (uintptr_t) tr_##t##_##s,
#define DEF(t) \
    TR(t,0) TR(t,1) TR(t,2) TR(t,3) TR(t,4) TR(t,5) TR(t,6) TR(t,7) TR(t,8) TR(t,9) TR(t,10) TR(t,11) TR(t,12) \
    TR(t,13) TR(t,14) TR(t,15) TR(t,16) TR(t,17) TR(t,18) TR(t,19) TR(t,20) TR(t,21) TR(t,22) TR(t,23) TR(t,24) \
    TR(t,25) TR(t,26) TR(t,27) TR(t,28) TR(t,29) TR(t,30) TR(t,31) TR(t,32) TR(t,33) TR(t,34) TR(t,35) TR(t,36) \
    TR(t,37) TR(t,38) TR(t,39) TR(t,40) TR(t,41) TR(t,42) TR(t,43) TR(t,44) TR(t,45) TR(t,46) TR(t,47) TR(t,48) \
    TR(t,49) TR(t,50) TR(t,51) TR(t,52) TR(t,53) TR(t,54) TR(t,55) TR(t,56) TR(t,57) TR(t,58) TR(t,59) TR(t,60) \
    TR(t,61) TR(t,62) TR(t,63) TR(t,64) TR(t,65) TR(t,66) TR(t,67) TR(t,68) TR(t,69) TR(t,70) TR(t,71) TR(t,72) \
    TR(t,73) TR(t,74) TR(t,75) TR(t,76) TR(t,77) TR(t,78) TR(t,79) TR(t,80) TR(t,81) TR(t,82) TR(t,83) TR(t,84) \
    TR(t,85) TR(t,86) TR(t,87) TR(t,88) TR(t,89) TR(t,90) TR(t,91) TR(t,92) TR(t,93) TR(t,94) TR(t,95) TR(t,96) \
    TR(t,97) TR(t,98) TR(t,99) TR(t,100) TR(t,101) TR(t,102) TR(t,103) TR(t,104) TR(t,105) TR(t,106) TR(t,107) \
    TR(t,108) TR(t,109) TR(t,110) TR(t,111) TR(t,112) TR(t,113) TR(t,114) TR(t,115) TR(t,116) TR(t,117) TR(t,118) \
    TR(t,119) TR(t,120) TR(t,121) TR(t,122) TR(t,123) TR(t,124) TR(t,125) TR(t,126) TR(t,127)
#define LIST(t) { \
    L(t,0) L(t,1) L(t,2) L(t,3) L(t,4) L(t,5) L(t,6) L(t,7) L(t,8) L(t,9) L(t,10) L(t,11) L(t,12) \
    L(t,13) L(t,14) L(t,15) L(t,16) L(t,17) L(t,18) L(t,19) L(t,20) L(t,21) L(t,22) L(t,23) L(t,24) \
    L(t,25) L(t,26) L(t,27) L(t,28) L(t,29) L(t,30) L(t,31) L(t,32) L(t,33) L(t,34) L(t,35) L(t,36) \
    L(t,37) L(t,38) L(t,39) L(t,40) L(t,41) L(t,42) L(t,43) L(t,44) L(t,45) L(t,46) L(t,47) L(t,48) \
    L(t,49) L(t,50) L(t,51) L(t,52) L(t,53) L(t,54) L(t,55) L(t,56) L(t,57) L(t,58) L(t,59) L(t,60) \
    L(t,61) L(t,62) L(t,63) L(t,64) L(t,65) L(t,66) L(t,67) L(t,68) L(t,69) L(t,70) L(t,71) L(t,72) \
    L(t,73) L(t,74) L(t,75) L(t,76) L(t,77) L(t,78) L(t,79) L(t,80) L(t,81) L(t,82) L(t,83) L(t,84) \
    L(t,85) L(t,86) L(t,87) L(t,88) L(t,89) L(t,90) L(t,91) L(t,92) L(t,93) L(t,94) L(t,95) L(t,96) \
    L(t,97) L(t,98) L(t,99) L(t,100) L(t,101) L(t,102) L(t,103) L(t,104) L(t,105) L(t,106) L(t,107) \
    L(t,108) L(t,109) L(t,110) L(t,111) L(t,112) L(t,113) L(t,114) L(t,115) L(t,116) L(t,117) L(t,118) \
    L(t,119) L(t,120) L(t,121) L(t,122) L(t,123) L(t,124) L(t,125) L(t,126) L(t,127) }
DEF(0) DEF(1) DEF(2) DEF(3) DEF(4) DEF(5) DEF(6) DEF(7)
static const uintptr_t TRAMPS[MAX_TABLES][MAX_SLOTS] = {LIST(0), LIST(1), LIST(2), LIST(3), LIST(4), LIST(5), LIST(6), LIST(7)};

__attribute__((constructor)) static void spy_init(void) {
    const char *path = getenv("SPY_REAL");
    real = dlopen(path ? path : "/usr/local/nvidia/lib64/libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!real) {
        fprintf(stderr, "table_spy: cannot open the real driver: %s\n", dlerror());
        abort();
    }
    for (size_t i = 0; i < NSYMS; i++) spy_ptrs[i] = dlsym(real, SPY_NAMES[i]);
    real_export = (export_fn)dlsym(real, "cuGetExportTable");
    real_proc_v2 = (proc_v2_fn)dlsym(real, "cuGetProcAddress_v2");
    real_proc_v1 = (proc_v1_fn)dlsym(real, "cuGetProcAddress");
    const char *log = getenv("SPY_LOG");
    if (log) {
        char name[512];
        snprintf(name, sizeof name, "%s.%d", log, getpid());
        logf_ = fopen(name, "w");
    }
    Dl_info me;
    if (dladdr((void *)spy_init, &me) && me.dli_fname) self_handle = dlopen(me.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    const char *want = getenv("SPY_TABLES");
    if (!want) want = "69a28e9f,1734dc26,da9151d3,6e163fbe";
    char buf[512];
    snprintf(buf, sizeof buf, "%s", want);
    for (char *tok = strtok(buf, ","); tok && ntables < MAX_TABLES; tok = strtok(NULL, ",")) {
        for (int k = 0; k < 4 && tok[2 * k]; k++) {
            unsigned v;
            sscanf(tok + 2 * k, "%2x", &v);
            spy_ids[ntables][k] = (unsigned char)v;
        }
        ntables++;
    }
}

/* At exit: the call sequence, one name per line, consecutive repeats folded ("name xN"). */
__attribute__((destructor)) static void spy_dump(void) {
    const char *log = getenv("SPY_SEQ");
    if (!log) return;
    char name[512];
    snprintf(name, sizeof name, "%s.%d", log, getpid());
    FILE *f = fopen(name, "w");
    if (!f) return;
    unsigned long n = spy_nseq < (1ul << 20) ? spy_nseq : (1ul << 20);
    char prev[64] = "", cur[64];
    unsigned long reps = 0;
    for (unsigned long k = 0; k <= n; k++) {
        if (k < n) {
            unsigned i = spy_seq[k];
            if (i == NOTE_EXPORT) snprintf(cur, sizeof cur, "cuGetExportTable");
            else if (i == NOTE_PROC) snprintf(cur, sizeof cur, "cuGetProcAddress");
            else if (i >= NOTE_SLOT) {
                char id[33];
                hexid(spy_ids[(i - NOTE_SLOT) / 1000], id);
                snprintf(cur, sizeof cur, "slot %.8s %u", id, (i - NOTE_SLOT) % 1000);
            } else snprintf(cur, sizeof cur, "%s", i < NSYMS ? SPY_NAMES[i] : "?");
        }
        if (k == n || strcmp(cur, prev) != 0) {
            if (reps) fprintf(f, reps > 1 ? "%s x%lu\n" : "%s\n", prev, reps);
            snprintf(prev, sizeof prev, "%s", cur);
            reps = 1;
        } else reps++;
    }
    fclose(f);
}

CUresult cuGetExportTable(const void **table, const void *id) {
    spy_note(NOTE_EXPORT);
    CUresult rc = real_export(table, id);
    char s[33];
    hexid(id, s);
    const void *ret = __builtin_return_address(0);
    for (int t = 0; rc == 0 && t < ntables; t++) {
        if (memcmp(spy_ids[t], id, 4) != 0) continue;
        const uintptr_t *orig = (const uintptr_t *)*table;
        int n = orig[0] < 0x1000 ? (int)(orig[0] / 8) : MAX_SLOTS;
        if (n > MAX_SLOTS) n = MAX_SLOTS;
        if (!copies[t][0] && !originals[t][1]) {
            for (int k = 0; k < n; k++) {
                originals[t][k] = orig[k];
                copies[t][k] = (k == 0 && orig[0] < 0x1000) ? orig[0] : TRAMPS[t][k];
            }
        }
        *table = copies[t];
        break;
    }
    if (logf_) {
        pthread_mutex_lock(&lock);
        fprintf(logf_, "table %s rc %d from %s\n", s, rc, lib_of(ret));
        fflush(logf_);
        pthread_mutex_unlock(&lock);
    }
    return rc;
}

/* A pointer the driver handed out -> our stub of the same export, so that calls made through
 * cuGetProcAddress are noted too. */
static void to_stub(void **pfn) {
    if (!*pfn || !self_handle) return;
    for (size_t i = 0; i < NSYMS; i++)
        if (spy_ptrs[i] == *pfn) {
            void *mine = dlsym(self_handle, SPY_NAMES[i]);
            if (mine) *pfn = mine;
            return;
        }
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    spy_note(NOTE_PROC);
    CUresult rc = real_proc_v2(sym, pfn, ver, flags, status);
    if (rc == 0 && pfn) to_stub(pfn);
    if (rc == 0 && pfn && sym) {
        if (!strcmp(sym, "cuGetExportTable")) *pfn = (void *)cuGetExportTable;
        else if (!strcmp(sym, "cuGetProcAddress")) *pfn = (void *)cuGetProcAddress_v2;
    }
    return rc;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    spy_note(NOTE_PROC);
    CUresult rc = real_proc_v1(sym, pfn, ver, flags);
    if (rc == 0 && pfn) to_stub(pfn);
    if (rc == 0 && pfn && sym) {
        if (!strcmp(sym, "cuGetExportTable")) *pfn = (void *)cuGetExportTable;
        else if (!strcmp(sym, "cuGetProcAddress")) *pfn = (void *)cuGetProcAddress_v2;
    }
    return rc;
}
