/*
 * cuda_audit: an LD_AUDIT module that logs how a program finds the CUDA driver: every cuGetProcAddress
 * request (symbol, version, flags, result) and every driver symbol looked up by name, whichever libcuda.so.1
 * answers (Gleam's shim or NVIDIA's). The CUDA runtime resolves the driver with dlsym and then through
 * cuGetProcAddress, so plain LD_PRELOAD sees none of it; the audit interface sees the dlsym (glibc >= 2.35
 * reports dlsym bindings to la_symbind64) and hands out a logging wrapper of the getter.
 *
 * Seen with the CUDA 13.0 runtime (torch 2.11): handing out a wrapper for what cuGetProcAddress returns for
 * "cuGetProcAddress" itself, or for cuGetExportTable (whether found by dlsym or by the getter), makes the
 * runtime crash (SIGSEGV) right after the lookup, before it calls the wrapper: it apparently checks where
 * those functions live. So export-table requests are not logged here (the shim logs them), and only the
 * getter found by dlsym is wrapped (the runtime keeps using that one).
 *
 *   gcc -O1 -shared -fPIC -o cuda_audit.so tools/cuda_audit.c
 *   LD_AUDIT=$PWD/cuda_audit.so CUDA_AUDIT_LOG=/tmp/audit.log gleam run ... -- python3 -c 'import torch; ...'
 *   sort /tmp/audit.log | uniq -c | sort -rn | head
 *
 * Log lines (CUDA_AUDIT_LOG, else stderr): `proc SYMBOL VERSION FLAGS -> RESULT`, `dlsym SYMBOL`.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef CUresult (*proc_v2_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*proc_v1_t)(const char *, void **, int, unsigned long long);

static proc_v2_t real_v2;
static proc_v1_t real_v1;
static int out_fd = -1;

/* Plain write(2) of a formatted line: the module lives in its own link namespace (its own libc), so it keeps
 * away from stdio buffers and locks that the program's threads could be holding. */
static void logf_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_line(const char *fmt, ...) {
    if (out_fd < 0) {
        const char *path = getenv("CUDA_AUDIT_LOG");
        out_fd = path ? open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : -1;
        if (out_fd < 0) out_fd = 2;
    }
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0) (void)!write(out_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static CUresult wrap_v2(const char *, void **, int, unsigned long long, int *);
static CUresult wrap_v1(const char *, void **, int, unsigned long long);

static CUresult wrap_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    CUresult r = real_v2(symbol, pfn, version, flags, status);
    logf_line("proc %s %d %llu -> %d\n", symbol ? symbol : "(null)", version, flags, r);
    return r;
}

static CUresult wrap_v1(const char *symbol, void **pfn, int version, unsigned long long flags) {
    CUresult r = real_v1(symbol, pfn, version, flags);
    logf_line("proc1 %s %d %llu -> %d\n", symbol ? symbol : "(null)", version, flags, r);
    return r;
}

unsigned la_version(unsigned version) { return version < LAV_CURRENT ? version : LAV_CURRENT; }

unsigned la_objopen(struct link_map *map, Lmid_t lmid, uintptr_t *cookie) {
    (void)map, (void)lmid, (void)cookie;
    return LA_FLG_BINDTO | LA_FLG_BINDFROM;
}

uintptr_t la_symbind64(Elf64_Sym *sym, unsigned ndx, uintptr_t *refcook, uintptr_t *defcook, unsigned *flags,
                       const char *name) {
    (void)ndx, (void)refcook, (void)defcook, (void)flags;
    if (strcmp(name, "cuGetProcAddress_v2") == 0) {
        real_v2 = (proc_v2_t)sym->st_value;
        logf_line("dlsym %s\n", name);
        return (uintptr_t)wrap_v2;
    }
    if (strcmp(name, "cuGetProcAddress") == 0) {
        real_v1 = (proc_v1_t)sym->st_value;
        logf_line("dlsym %s\n", name);
        return (uintptr_t)wrap_v1;
    }
    if (strncmp(name, "cu", 2) == 0 && name[2] >= 'A' && name[2] <= 'Z') logf_line("dlsym %s\n", name);
    return sym->st_value;
}
