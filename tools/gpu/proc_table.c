/*
 * proc_table: record what the real driver's cuGetProcAddress_v2 returns, so the shim can
 * answer the same way.
 *
 * Usage: proc_table <exports list> > proc-table.tsv
 *
 * The exports list holds one exported libcuda symbol per line. Every distinct base name
 * (suffixes _ptds/_ptsz and then _vN stripped) is queried for flags 0 (default), 1 (legacy
 * stream) and 2 (per-thread default stream) at each cudaVersion breakpoint in VERSIONS. The
 * returned pointer is mapped back to an exported name by dlsym-ing every candidate name (the
 * base with _v2.._v4 and _ptds/_ptsz, plus every listed export with the same base) and comparing
 * pointers, with dladdr as a fallback. Output (TSV, '#' lines are comments):
 *
 *   base <TAB> flags <TAB> min_version <TAB> symbol
 *
 * one row per breakpoint: the row holds from min_version up to the next row of the same base and
 * flags. symbol is "-" when the driver reports the symbol as not found (or the version as not
 * sufficient), and "?+0xOFFSET" for a pointer into libcuda that no exported name matches.
 *
 * Needs no CUDA headers: everything is resolved with dlopen/dlsym.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long cuuint64_t;
typedef CUresult (*cu_init_fn)(unsigned int);
typedef CUresult (*cu_driver_get_version_fn)(int *);
typedef CUresult (*cu_get_proc_address_v2_fn)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*cu_get_proc_address_v1_fn)(const char *, void **, int, cuuint64_t);

#define CUDA_ERROR_NOT_FOUND 500
#define MAX_NAME 256
#define MAX_EXPORTS 8192

static const int VERSIONS[] = {
    1000,  2000,  2010,  2020,  2030,  3000,  3010,  3020,  3030,  4000,  4010,  4020,
    5000,  5050,  6000,  6050,  7000,  7050,  8000,  9000,  9010,  9020,  10000, 10010,
    10020, 11000, 11010, 11020, 11030, 11040, 11050, 11060, 11070, 11080, 12000, 12010,
    12020, 12030, 12040, 12050, 12060, 12080, 12090, 13000,
};
#define NVERSIONS ((int)(sizeof VERSIONS / sizeof VERSIONS[0]))

static const char *const STATUS_NAMES[] = {"success", "symbol-not-found", "version-not-sufficient"};

struct export_entry {
    char name[MAX_NAME];
    char base[MAX_NAME];
};

static struct export_entry exports[MAX_EXPORTS];
static int nexports;
static char *bases[MAX_EXPORTS];
static int nbases;

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s);
    size_t m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* Strip _ptds/_ptsz, then any _vN (N all digits). */
static void base_name(const char *name, char *out)
{
    size_t len = strnlen(name, MAX_NAME - 1);
    memmove(out, name, len);
    out[len] = '\0';
    if (ends_with(out, "_ptds") || ends_with(out, "_ptsz")) {
        out[strlen(out) - 5] = '\0';
    }
    char *v = strrchr(out, '_');
    if (v && v[1] == 'v' && v[2] != '\0') {
        int digits = 1;
        for (const char *p = v + 2; *p; p++) {
            if (*p < '0' || *p > '9') {
                digits = 0;
            }
        }
        if (digits) {
            *v = '\0';
        }
    }
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void read_exports(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        perror(path);
        exit(1);
    }
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, " \t\r\n")] = '\0';
        if (line[0] == '\0' || line[0] == '#') {
            continue;
        }
        if (strlen(line) >= MAX_NAME - 16) {
            fprintf(stderr, "proc_table: skipping over-long name %s\n", line);
            continue;
        }
        if (nexports == MAX_EXPORTS) {
            fprintf(stderr, "proc_table: too many exports\n");
            exit(1);
        }
        struct export_entry *e = &exports[nexports++];
        snprintf(e->name, MAX_NAME, "%s", line);
        base_name(e->name, e->base);
    }
    fclose(f);

    for (int i = 0; i < nexports; i++) {
        bases[nbases++] = exports[i].base;
    }
    qsort(bases, (size_t)nbases, sizeof bases[0], cmp_str);
    int unique = 0;
    for (int i = 0; i < nbases; i++) {
        if (unique == 0 || strcmp(bases[unique - 1], bases[i]) != 0) {
            bases[unique++] = bases[i];
        }
    }
    nbases = unique;
}

/* Map a function pointer back to a name; writes into out. */
static void resolve(void *lib, const char *base, void *fn, char *out, size_t outlen)
{
    static const char *const versions[] = {"", "_v2", "_v3", "_v4"};
    static const char *const streams[] = {"", "_ptds", "_ptsz"};
    char name[MAX_NAME];
    for (int v = 0; v < 4; v++) {
        for (int s = 0; s < 3; s++) {
            snprintf(name, sizeof name, "%s%s%s", base, versions[v], streams[s]);
            void *p = dlsym(lib, name);
            if (p && p == fn) {
                snprintf(out, outlen, "%s", name);
                return;
            }
        }
    }
    for (int i = 0; i < nexports; i++) {
        if (strcmp(exports[i].base, base) == 0) {
            void *p = dlsym(lib, exports[i].name);
            if (p && p == fn) {
                snprintf(out, outlen, "%s", exports[i].name);
                return;
            }
        }
    }
    Dl_info info;
    if (dladdr(fn, &info) != 0) {
        if (info.dli_sname && info.dli_saddr == fn) {
            snprintf(out, outlen, "%s", info.dli_sname);
            return;
        }
        snprintf(out, outlen, "?+0x%lx", (unsigned long)((uintptr_t)fn - (uintptr_t)info.dli_fbase));
        return;
    }
    snprintf(out, outlen, "?%p", fn);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s <exports list>\n", argv[0]);
        return 1;
    }
    read_exports(argv[1]);

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "proc_table: dlopen(libcuda.so.1): %s\n", dlerror());
        return 2;
    }
    cu_init_fn cu_init = (cu_init_fn)dlsym(lib, "cuInit");
    cu_driver_get_version_fn cu_driver_get_version =
        (cu_driver_get_version_fn)dlsym(lib, "cuDriverGetVersion");
    cu_get_proc_address_v2_fn gpa2 = (cu_get_proc_address_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    cu_get_proc_address_v1_fn gpa1 = (cu_get_proc_address_v1_fn)dlsym(lib, "cuGetProcAddress");
    if (!cu_init || !cu_driver_get_version || (!gpa2 && !gpa1)) {
        fprintf(stderr, "proc_table: libcuda.so.1 lacks cuInit, cuDriverGetVersion or cuGetProcAddress\n");
        return 2;
    }
    CUresult r = cu_init(0);
    if (r != 0) {
        fprintf(stderr, "proc_table: cuInit(0) returned %d (continuing: cuGetProcAddress needs no init)\n", r);
    }
    int driver_version = 0;
    r = cu_driver_get_version(&driver_version);
    if (r != 0) {
        fprintf(stderr, "proc_table: cuDriverGetVersion returned %d\n", r);
    }

    Dl_info lib_info;
    const char *lib_path = "?";
    if (dladdr((void *)cu_init, &lib_info) != 0 && lib_info.dli_fname) {
        lib_path = lib_info.dli_fname;
    }

    printf("# proc-table: cuGetProcAddress%s results of %s\n", gpa2 ? "_v2" : " (v1)", lib_path);
    printf("# driver_version\t%d\n", driver_version);
    printf("# flags: 0 = CU_GET_PROC_ADDRESS_DEFAULT, 1 = LEGACY_STREAM, 2 = PER_THREAD_DEFAULT_STREAM\n");
    printf("# a row holds from min_version until the next row of the same base and flags\n");
    printf("# base\tflags\tmin_version\tsymbol\n");

    long rows = 0;
    long other_errors = 0;
    long unresolved = 0;
    for (int b = 0; b < nbases; b++) {
        const char *base = bases[b];
        for (int flags = 0; flags <= 2; flags++) {
            char prev[MAX_NAME] = "";
            for (int v = 0; v < NVERSIONS; v++) {
                void *fn = NULL;
                int status = -1;
                if (gpa2) {
                    r = gpa2(base, &fn, VERSIONS[v], (cuuint64_t)flags, &status);
                } else {
                    r = gpa1(base, &fn, VERSIONS[v], (cuuint64_t)flags);
                }
                char sym[MAX_NAME];
                if (r == 0 && fn != NULL) {
                    resolve(lib, base, fn, sym, sizeof sym);
                    if (sym[0] == '?') {
                        unresolved++;
                    }
                } else {
                    snprintf(sym, sizeof sym, "-");
                    if (r != CUDA_ERROR_NOT_FOUND && r != 0) {
                        other_errors++;
                        fprintf(stderr, "proc_table: %s flags=%d version=%d: error %d status %s\n", base,
                                flags, VERSIONS[v], r,
                                status >= 0 && status <= 2 ? STATUS_NAMES[status] : "?");
                    }
                }
                if (v == 0 || strcmp(sym, prev) != 0) {
                    printf("%s\t%d\t%d\t%s\n", base, flags, VERSIONS[v], sym);
                    rows++;
                    snprintf(prev, sizeof prev, "%s", sym);
                }
            }
        }
    }
    fprintf(stderr, "proc_table: driver %d, %d exports, %d base names, %ld rows, %ld unresolved pointers, "
            "%ld unexpected errors\n", driver_version, nexports, nbases, rows, unresolved, other_errors);
    return 0;
}
