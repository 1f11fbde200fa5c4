/*
 * integrity_probe: records what NVIDIA's libcuda answers to the CUDA runtime's integrity check (export table
 * D4082055-BDE6-704B-8D34-BA123C66E1F2, slot 1), with every input the answer depends on, as a fixture for
 * remoting/shim/src/integrity.rs. It also surveys the export tables the runtime asks for (return code,
 * address, slot 0, the object each slot points into) and what the driver answers for unknown UUIDs.
 *
 * Build and run on the GPU machine (no CUDA headers needed; links only libdl and libpthread):
 *   gcc -O1 -o integrity_probe tools/gpu/integrity_probe.c -ldl -lpthread
 *   ./integrity_probe > integrity-fixture.txt 2> export-tables.txt
 * or OUT=... bash scripts/gpu/integrity-probe.sh. LIBCUDA=/path/to/libcuda.so.1 picks the driver.
 *
 * stdout (the fixture; parsed by integrity::fixture::Fixture::parse):
 *   driver_version N | pid N | pthread_self 0xX | gettid N | cudart_table 0xX | integrity_table 0xX |
 *   check_fn 0xX | device ORD uuid HEX32 domain D bus B device V |
 *   case version V seconds S result R out HEX32 [thread 0xX]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct { unsigned char bytes[16]; } CUuuid;
typedef CUresult (*check_fn_t)(unsigned int version, unsigned long long seconds, unsigned char out[16]);

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDriverGetVersion)(int *);
static CUresult (*p_cuDeviceGetCount)(int *);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetUuid)(CUuuid *, CUdevice);
static CUresult (*p_cuDeviceGetAttribute)(int *, int, CUdevice);
static CUresult (*p_cuGetExportTable)(const void **, const CUuuid *);

enum { ATTR_PCI_BUS_ID = 33, ATTR_PCI_DEVICE_ID = 34, ATTR_PCI_DOMAIN_ID = 50 };

static const struct { const char *name; const char *hex; } TABLES[] = {
    {"CUDART_INTERFACE", "6bd5fb6c5bf4e74a8987d93912fd9df9"},
    {"TOOLS_TLS", "42d85a8123f6cb478298f6e78a3aecdc"},
    {"TOOLS_RUNTIME_CALLBACK_HOOKS", "a094798c2e742e7493f20800200c0a66"},
    {"CONTEXT_LOCAL_STORAGE_V0301", "c693336e1121df11a8c368f355d89593"},
    {"CTX_CREATE_BYPASS", "0ca50b8c1004929a89a7d0df10e77286"},
    {"HEAP_ACCESS", "195bcbf4d67d024aacc51d29cea631ae"},
    {"DEVICE_EXTENDED_RT", "b10541e1f7c7c74a9f64f223be99f1e2"},
    {"INTEGRITY_CHECK", "d4082055bde6704b8d34ba123c66e1f2"},
    {"CONTEXT_CHECKS", "263e88607cd2614392f6bbd5006dfa7e"},
    {"unknown_f8cff951", "f8cff95121468b4eb9e2fb469e7c0dd9"},
    {"unknown_1734dc26", "1734dc26800d47458726c0f1e7dd8bca"},
    {"unknown_21318c60", "21318c60971432488ca641ff7324c8f2"},
    {"unknown_69a28e9f", "69a28e9f24498b47b030c5da330ea4e9"},
    {"unknown_da9151d3", "da9151d33ae6cc41a5c04f26d533e328"},
    {"unknown_6e163fbe", "6e163fbeb958444d835ce182aff1991e"},
    {"HYBRID_CUDART_windows", "dd9e98a4f410484499b0e2aeb7b432b5"},
    {"made_up_zeros", "00000000000000000000000000000000"},
    {"made_up_random", "0123456789abcdeffedcba9876543210"},
};

static void parse_uuid(const char *hex, CUuuid *out) {
    for (int i = 0; i < 16; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        out->bytes[i] = (unsigned char)v;
    }
}

static void print_hex(FILE *f, const unsigned char *b, int n) {
    for (int i = 0; i < n; i++) fprintf(f, "%02x", b[i]);
}

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "error: libcuda has no %s\n", name);
        exit(2);
    }
    return p;
}

/* Where a slot points: object basename and symbol (or offset in the object). */
static void describe(FILE *f, const void *p) {
    Dl_info info;
    if (p && dladdr(p, &info) && info.dli_fname) {
        const char *base = strrchr(info.dli_fname, '/');
        base = base ? base + 1 : info.dli_fname;
        if (info.dli_sname)
            fprintf(f, "%s:%s+0x%lx", base, info.dli_sname, (unsigned long)((const char *)p - (const char *)info.dli_saddr));
        else
            fprintf(f, "%s+0x%lx", base, (unsigned long)((const char *)p - (const char *)info.dli_fbase));
    } else {
        fprintf(f, "(not code)");
    }
}

static void survey(void) {
    fprintf(stderr, "# export-table survey: name uuid rc address slot0 [slots...]\n");
    for (size_t t = 0; t < sizeof TABLES / sizeof TABLES[0]; t++) {
        CUuuid id;
        const void *table = (const void *)0x1;
        parse_uuid(TABLES[t].hex, &id);
        CUresult rc = p_cuGetExportTable(&table, &id);
        fprintf(stderr, "table %s %s rc %d address %p", TABLES[t].name, TABLES[t].hex, rc, table);
        if (rc != 0 || !table || table == (const void *)0x1) {
            fprintf(stderr, "\n");
            continue;
        }
        const uintptr_t *slots = table;
        uintptr_t slot0 = slots[0];
        fprintf(stderr, " slot0 0x%lx\n", (unsigned long)slot0);
        /* Slot 0 is the byte size in most tables; otherwise show 8 slots. */
        size_t n = (slot0 >= 8 && slot0 <= 8 * 256 && slot0 % 8 == 0) ? slot0 / 8 : 8;
        for (size_t i = 0; i < n; i++) {
            fprintf(stderr, "  slot %zu 0x%lx ", i, (unsigned long)slots[i]);
            if (i > 0 || n == 8) describe(stderr, (const void *)slots[i]);
            fprintf(stderr, "\n");
        }
        /* Some tables are followed by further size-prefixed sub-tables: show 40 more words. */
        if (n != 8) {
            for (size_t i = n; i < n + 40; i++) {
                fprintf(stderr, "  after %zu 0x%lx ", i, (unsigned long)slots[i]);
                describe(stderr, (const void *)slots[i]);
                fprintf(stderr, "\n");
            }
        }
    }
    const void *table = (const void *)0x1;
    CUuuid id;
    parse_uuid(TABLES[0].hex, &id);
    fprintf(stderr, "null_table_pointer rc %d\n", p_cuGetExportTable(NULL, &id));
    fprintf(stderr, "null_uuid rc %d table %p\n", p_cuGetExportTable(&table, NULL), table);
}

struct thread_case { check_fn_t check; unsigned version; unsigned long long seconds; CUresult rc; unsigned char out[16]; uintptr_t self; };

static void *run_in_thread(void *arg) {
    struct thread_case *c = arg;
    c->self = (uintptr_t)pthread_self();
    c->rc = c->check(c->version, c->seconds, c->out);
    return NULL;
}

int main(void) {
    const char *path = getenv("LIBCUDA") ? getenv("LIBCUDA") : "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "error: cannot load %s: %s\n", path, dlerror());
        return 2;
    }
    p_cuInit = sym(lib, "cuInit");
    p_cuDriverGetVersion = sym(lib, "cuDriverGetVersion");
    p_cuDeviceGetCount = sym(lib, "cuDeviceGetCount");
    p_cuDeviceGet = sym(lib, "cuDeviceGet");
    p_cuDeviceGetUuid = dlsym(lib, "cuDeviceGetUuid_v2") ? dlsym(lib, "cuDeviceGetUuid_v2") : sym(lib, "cuDeviceGetUuid");
    p_cuDeviceGetAttribute = sym(lib, "cuDeviceGetAttribute");
    p_cuGetExportTable = sym(lib, "cuGetExportTable");
    {
        Dl_info info;
        if (dladdr((void *)p_cuInit, &info)) fprintf(stderr, "# libcuda: %s\n", info.dli_fname);
    }

    /* What does an unknown UUID get before cuInit? (cudart asks for f8cff951 first, before cuInit.) */
    {
        CUuuid id;
        const void *t = NULL;
        parse_uuid("0123456789abcdeffedcba9876543210", &id);
        fprintf(stderr, "before_cuInit made_up rc %d\n", p_cuGetExportTable(&t, &id));
        parse_uuid("f8cff95121468b4eb9e2fb469e7c0dd9", &id);
        fprintf(stderr, "before_cuInit f8cff951 rc %d\n", p_cuGetExportTable(&t, &id));
    }

    CUresult rc = p_cuInit(0);
    if (rc != 0) {
        fprintf(stderr, "error: cuInit returned %d\n", rc);
        return 1;
    }
    int driver = 0, count = 0;
    p_cuDriverGetVersion(&driver);
    p_cuDeviceGetCount(&count);

    const void *cudart = NULL, *integrity = NULL;
    CUuuid id;
    parse_uuid("6bd5fb6c5bf4e74a8987d93912fd9df9", &id);
    if ((rc = p_cuGetExportTable(&cudart, &id)) != 0) {
        fprintf(stderr, "error: CUDART_INTERFACE: %d\n", rc);
        return 1;
    }
    parse_uuid("d4082055bde6704b8d34ba123c66e1f2", &id);
    if ((rc = p_cuGetExportTable(&integrity, &id)) != 0) {
        fprintf(stderr, "error: INTEGRITY_CHECK: %d\n", rc);
        return 1;
    }
    check_fn_t check = (check_fn_t)((const void *const *)integrity)[1];

    printf("# integrity_probe: NVIDIA's integrity-check answers and their inputs\n");
    printf("driver_version %d\n", driver);
    printf("pid %d\n", (int)getpid());
    printf("pthread_self 0x%lx\n", (unsigned long)(uintptr_t)pthread_self());
    printf("gettid %ld\n", (long)syscall(SYS_gettid));
    printf("cudart_table %p\n", cudart);
    printf("integrity_table %p\n", integrity);
    printf("check_fn %p\n", (void *)check);
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        CUuuid uuid;
        int domain = -1, bus = -1, device = -1;
        p_cuDeviceGet(&dev, i);
        p_cuDeviceGetUuid(&uuid, dev);
        p_cuDeviceGetAttribute(&domain, ATTR_PCI_DOMAIN_ID, dev);
        p_cuDeviceGetAttribute(&bus, ATTR_PCI_BUS_ID, dev);
        p_cuDeviceGetAttribute(&device, ATTR_PCI_DEVICE_ID, dev);
        printf("device %d uuid ", i);
        print_hex(stdout, uuid.bytes, 16);
        printf(" domain %d bus %d device %d\n", domain, bus, device);
    }

    /* Every mode (version % 10), around the versions runtimes 12.8 and 13.0 use, at two times. */
    static const unsigned bases[] = {13000, 12080, 13010};
    static const unsigned long long times[] = {1767225600ULL, 1700000000ULL};
    for (size_t b = 0; b < sizeof bases / sizeof bases[0]; b++) {
        for (unsigned k = 0; k < 10; k++) {
            for (size_t t = 0; t < sizeof times / sizeof times[0]; t++) {
                if (b > 0 && t > 0) continue;
                unsigned char out[16];
                memset(out, 0xAA, sizeof out);
                rc = check(bases[b] + k, times[t], out);
                printf("case version %u seconds %llu result %d out ", bases[b] + k, times[t], rc);
                print_hex(stdout, out, 16);
                printf("\n");
            }
        }
    }
    /* The same call from another thread: shows whether (and how) the thread enters the hash. */
    {
        struct thread_case c = {check, 13002, 1767225600ULL, -1, {0}, 0};
        pthread_t th;
        pthread_create(&th, NULL, run_in_thread, &c);
        pthread_join(th, NULL);
        printf("case version %u seconds %llu result %d out ", c.version, c.seconds, c.rc);
        print_hex(stdout, c.out, 16);
        printf(" thread 0x%lx\n", (unsigned long)c.self);
    }
    fflush(stdout);
    survey();
    return 0;
}
