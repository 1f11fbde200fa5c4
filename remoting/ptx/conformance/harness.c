/*
 * Conformance recording harness (runs on a machine with a real NVIDIA GPU).
 *
 * Usage: harness <case file> <ptx dir> <data dir>
 *
 * Reads one .case file (format in remoting/ptx/conformance/README.md), loads the PTX it names
 * (relative to <ptx dir>) with cuModuleLoadDataEx, fills every pointer parameter from its
 * init= rule, writes <data dir>/p<i>.in for every pointer parameter, launches the kernel once,
 * synchronizes, and writes <data dir>/p<i>.out for every pointer parameter that has a check=.
 * Buffers are raw little-endian element arrays. <i> is the 0-based index of the parameter in
 * declaration order (scalars count too).
 *
 * Resources (`resource` directives): CUDA arrays (cuArray3DCreate, with the layered and surface
 * flags the case asks for), linear memory and pitched 2D memory, filled from their init= rule
 * (random stream 1000 + k for the k-th resource) and written to <data dir>/<name>.in as dense
 * texels (row-major: x, then rows, then slices, then layers); after the launch, resources with a
 * check= are read back into <data dir>/<name>.out. `param tex` and `param surf` create texture and
 * surface objects over them (cuTexObjectCreate / cuSurfObjectCreate) and pass the handles.
 *
 * random init: a splitmix64 stream seeded by FNV-1a(case name) ^ (index * golden ratio);
 * integers take the low bits of each draw (uniform over the type's range), f32/f64 are uniform
 * in [-1, 1) (multiples of 2^-23 / 2^-52), f16 are k/1024 and bf16 k/128 for uniform integer k
 * in [-1024, 1024) / [-128, 128) (so the values are exact in the narrow type).
 * iota init: element i holds i converted to the element type (rounded to nearest for f16/bf16).
 *
 * Exit status: 0 on success, 1 on a bad case file or I/O error, 2 on any CUDA error.
 */
#include <cuda.h>

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

#define MAX_PARAMS 32
#define MAX_RESOURCES 8
#define MAX_LINE 1024
#define MAX_BUFFER_BYTES (64u * 1024u * 1024u)
#define MAX_RESOURCE_BYTES (16u * 1024u * 1024u)

enum elem {
    E_U8, E_U16, E_U32, E_S32, E_U64, E_S64, E_F16, E_BF16, E_F32, E_F64, E_S8, E_S16, E_INVALID
};

static const char *const ELEM_NAMES[] = {
    "u8", "u16", "u32", "s32", "u64", "s64", "f16", "bf16", "f32", "f64", "s8", "s16",
};
static const size_t ELEM_SIZES[] = {1, 2, 4, 4, 8, 8, 2, 2, 4, 8, 1, 2};

enum init { I_ZERO, I_IOTA, I_RANDOM };

enum param_kind { P_SCALAR, P_PTR, P_TEX, P_SURF };

enum resource_kind { R_ARRAY, R_LINEAR, R_PITCH2D };

struct resource {
    char name[64];
    enum resource_kind kind;
    enum elem elem; /* channel type: u8 u16 u32 s8 s16 s32 f16 f32 */
    unsigned channels;
    size_t width, height, depth, layers; /* height/depth 0 where absent, layers 0 if not layered */
    int surface;
    enum init init;
    int checked;
    void *host; /* dense texels */
    size_t bytes;
    CUarray array;
    CUdeviceptr alloc; /* linear / pitch2d allocation */
    CUdeviceptr dev;   /* its (aligned) start */
    size_t pitch;
};

/* Sampling state of a `param tex`. */
struct tex_spec {
    int resource;
    CUfilter_mode filter;
    CUaddress_mode address[3];
    int normalized;
    int read_as_integer;
    float border[4];
};

struct param {
    enum param_kind kind;
    int is_ptr;
    enum elem elem;
    /* ptr */
    size_t count;
    enum init init;
    int checked;
    void *host;
    CUdeviceptr dev;
    /* tex / surf */
    struct tex_spec tex;
    CUtexObject tex_obj;
    CUsurfObject surf_obj;
    /* scalar: storage whose address goes into kernelParams */
    union {
        uint32_t u32;
        int32_t s32;
        uint64_t u64;
        int64_t s64;
        float f32;
        double f64;
        CUdeviceptr ptr;
        unsigned long long handle;
    } value;
};

struct test_case {
    char name[256];
    char ptx[512];
    char kernel[256];
    unsigned grid[3];
    unsigned block[3];
    unsigned shared;
    int nparams;
    struct param params[MAX_PARAMS];
    int nresources;
    struct resource resources[MAX_RESOURCES];
};

static const char *case_path = "?";

__attribute__((noreturn, format(printf, 2, 3))) static void fail(int code, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "harness: %s: ", case_path);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(code);
}

static void check_cu(CUresult r, const char *what)
{
    if (r != CUDA_SUCCESS) {
        const char *name = NULL;
        const char *desc = NULL;
        cuGetErrorName(r, &name);
        cuGetErrorString(r, &desc);
        fail(2, "%s failed: %s (%d): %s", what, name ? name : "?", (int)r, desc ? desc : "?");
    }
}

/* ---- parsing ---- */

static enum elem parse_elem(const char *s)
{
    for (int i = 0; i < E_INVALID; i++) {
        if (strcmp(s, ELEM_NAMES[i]) == 0) {
            return (enum elem)i;
        }
    }
    return E_INVALID;
}

static unsigned long long parse_uint(const char *s, int line)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-') {
        fail(1, "line %d: bad unsigned number '%s'", line, s);
    }
    return v;
}

static long long parse_int(const char *s, int line)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 0);
    if (errno != 0 || end == s || *end != '\0') {
        fail(1, "line %d: bad integer '%s'", line, s);
    }
    return v;
}

static double parse_float(const char *s, int line)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0') {
        fail(1, "line %d: bad float '%s'", line, s);
    }
    return v;
}

static int split(char *line, char **tok, int max)
{
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(line, " \t\r\n", &save); t; t = strtok_r(NULL, " \t\r\n", &save)) {
        if (n == max) {
            return -1;
        }
        tok[n++] = t;
    }
    return n;
}

static void parse_dim3(char **tok, int ntok, unsigned out[3], int line)
{
    if (ntok != 4) {
        fail(1, "line %d: '%s' needs 3 values", line, tok[0]);
    }
    for (int i = 0; i < 3; i++) {
        unsigned long long v = parse_uint(tok[1 + i], line);
        if (v == 0 || v > 0x7fffffffull) {
            fail(1, "line %d: dimension out of range", line);
        }
        out[i] = (unsigned)v;
    }
}

static int find_resource(const struct test_case *tc, const char *name)
{
    for (int i = 0; i < tc->nresources; i++) {
        if (strcmp(tc->resources[i].name, name) == 0) {
            return i;
        }
    }
    return -1;
}

static enum init parse_init_rule(const char *s, int line)
{
    if (strcmp(s, "init=zero") == 0) {
        return I_ZERO;
    }
    if (strcmp(s, "init=iota") == 0) {
        return I_IOTA;
    }
    if (strcmp(s, "init=random") == 0) {
        return I_RANDOM;
    }
    fail(1, "line %d: bad init '%s'", line, s);
}

/* resource <name> <array|linear|pitch2d> <format> <channels> <sizes..> [layers=N] [surface] init=.. [check=..] */
static void parse_resource(struct test_case *tc, char **tok, int ntok, int line)
{
    if (tc->nresources == MAX_RESOURCES) {
        fail(1, "line %d: too many resources", line);
    }
    if (ntok < 6) {
        fail(1, "line %d: resource <name> <kind> <format> <channels> <sizes..> init=..", line);
    }
    struct resource *r = &tc->resources[tc->nresources];
    memset(r, 0, sizeof *r);
    if (strlen(tok[1]) >= sizeof r->name || strspn(tok[1], "abcdefghijklmnopqrstuvwxyz0123456789_") != strlen(tok[1])) {
        fail(1, "line %d: resource name '%s': use [a-z0-9_]", line, tok[1]);
    }
    if (find_resource(tc, tok[1]) >= 0) {
        fail(1, "line %d: resource '%s' declared twice", line, tok[1]);
    }
    snprintf(r->name, sizeof r->name, "%s", tok[1]);
    if (strcmp(tok[2], "array") == 0) {
        r->kind = R_ARRAY;
    } else if (strcmp(tok[2], "linear") == 0) {
        r->kind = R_LINEAR;
    } else if (strcmp(tok[2], "pitch2d") == 0) {
        r->kind = R_PITCH2D;
    } else {
        fail(1, "line %d: unknown resource kind '%s'", line, tok[2]);
    }
    r->elem = parse_elem(tok[3]);
    switch (r->elem) {
    case E_U8: case E_U16: case E_U32: case E_S8: case E_S16: case E_S32: case E_F16: case E_F32: break;
    default: fail(1, "line %d: unknown channel format '%s'", line, tok[3]);
    }
    unsigned long long ch = parse_uint(tok[4], line);
    if (ch != 1 && ch != 2 && ch != 4) {
        fail(1, "line %d: %llu channels: use 1, 2 or 4", line, ch);
    }
    r->channels = (unsigned)ch;
    size_t sizes[3] = {0, 0, 0};
    int nsizes = 0;
    int have_init = 0;
    for (int i = 5; i < ntok; i++) {
        if (strncmp(tok[i], "layers=", 7) == 0) {
            r->layers = (size_t)parse_uint(tok[i] + 7, line);
        } else if (strcmp(tok[i], "surface") == 0) {
            r->surface = 1;
        } else if (strncmp(tok[i], "init=", 5) == 0) {
            r->init = parse_init_rule(tok[i], line);
            have_init = 1;
        } else if (strncmp(tok[i], "check=", 6) == 0) {
            r->checked = 1;
        } else {
            if (nsizes == 3) {
                fail(1, "line %d: too many sizes", line);
            }
            unsigned long long v = parse_uint(tok[i], line);
            if (v == 0 || v > 65536) {
                fail(1, "line %d: size out of range", line);
            }
            sizes[nsizes++] = (size_t)v;
        }
    }
    if (!have_init || nsizes == 0) {
        fail(1, "line %d: resource needs sizes and init=", line);
    }
    if (r->kind == R_LINEAR && (nsizes != 1 || r->layers || r->surface)) {
        fail(1, "line %d: linear <format> <channels> <count>", line);
    }
    if (r->kind == R_PITCH2D && (nsizes != 2 || r->layers || r->surface)) {
        fail(1, "line %d: pitch2d <format> <channels> <width> <height>", line);
    }
    if (r->kind == R_ARRAY && r->layers && nsizes == 3) {
        fail(1, "line %d: layered arrays are 1D or 2D", line);
    }
    r->width = sizes[0];
    r->height = sizes[1];
    r->depth = sizes[2];
    size_t texels = r->width * (r->height ? r->height : 1) * (r->depth ? r->depth : 1) * (r->layers ? r->layers : 1);
    r->bytes = texels * r->channels * ELEM_SIZES[r->elem];
    if (r->bytes > MAX_RESOURCE_BYTES) {
        fail(1, "line %d: resource too large", line);
    }
    tc->nresources++;
}

static CUaddress_mode parse_address_mode(const char *s, size_t n, int line)
{
    if (n == 4 && strncmp(s, "wrap", 4) == 0) {
        return CU_TR_ADDRESS_MODE_WRAP;
    }
    if (n == 5 && strncmp(s, "clamp", 5) == 0) {
        return CU_TR_ADDRESS_MODE_CLAMP;
    }
    if (n == 6 && strncmp(s, "mirror", 6) == 0) {
        return CU_TR_ADDRESS_MODE_MIRROR;
    }
    if (n == 6 && strncmp(s, "border", 6) == 0) {
        return CU_TR_ADDRESS_MODE_BORDER;
    }
    fail(1, "line %d: unknown address mode '%.*s'", line, (int)n, s);
}

/* param tex <resource> [filter=..] [address=m[,m[,m]]] [normalized] [read=element|normalized] [border=r,g,b,a]
 * param surf <resource> */
static void parse_object_param(struct test_case *tc, struct param *p, char **tok, int ntok, int line)
{
    int surf = strcmp(tok[1], "surf") == 0;
    p->kind = surf ? P_SURF : P_TEX;
    p->tex.resource = find_resource(tc, tok[2]);
    if (p->tex.resource < 0) {
        fail(1, "line %d: no resource '%s' declared before", line, tok[2]);
    }
    if (surf) {
        const struct resource *r = &tc->resources[p->tex.resource];
        if (ntok != 3 || r->kind != R_ARRAY || !r->surface) {
            fail(1, "line %d: param surf <array resource declared with `surface`>", line);
        }
        return;
    }
    p->tex.filter = CU_TR_FILTER_MODE_POINT;
    for (int d = 0; d < 3; d++) {
        p->tex.address[d] = CU_TR_ADDRESS_MODE_CLAMP;
    }
    for (int i = 3; i < ntok; i++) {
        const char *t = tok[i];
        if (strcmp(t, "filter=point") == 0) {
            p->tex.filter = CU_TR_FILTER_MODE_POINT;
        } else if (strcmp(t, "filter=linear") == 0) {
            p->tex.filter = CU_TR_FILTER_MODE_LINEAR;
        } else if (strcmp(t, "normalized") == 0) {
            p->tex.normalized = 1;
        } else if (strcmp(t, "read=element") == 0) {
            p->tex.read_as_integer = 1;
        } else if (strcmp(t, "read=normalized") == 0) {
            p->tex.read_as_integer = 0;
        } else if (strncmp(t, "address=", 8) == 0) {
            const char *m = t + 8;
            int d = 0;
            while (*m) {
                if (d == 3) {
                    fail(1, "line %d: at most 3 address modes", line);
                }
                size_t n = strcspn(m, ",");
                p->tex.address[d++] = parse_address_mode(m, n, line);
                m += n;
                if (*m == ',') {
                    m++;
                }
            }
            if (d == 0) {
                fail(1, "line %d: empty address=", line);
            }
            for (; d < 3; d++) {
                p->tex.address[d] = p->tex.address[d - 1];
            }
        } else if (strncmp(t, "border=", 7) == 0) {
            char buf[128];
            snprintf(buf, sizeof buf, "%s", t + 7);
            char *save = NULL;
            int k = 0;
            for (char *v = strtok_r(buf, ",", &save); v; v = strtok_r(NULL, ",", &save)) {
                if (k == 4) {
                    fail(1, "line %d: border needs 4 values", line);
                }
                p->tex.border[k++] = (float)parse_float(v, line);
            }
            if (k != 4) {
                fail(1, "line %d: border needs 4 values", line);
            }
        } else {
            fail(1, "line %d: unknown texture setting '%s'", line, t);
        }
    }
}

static void parse_param(struct test_case *tc, char **tok, int ntok, int line)
{
    if (tc->nparams == MAX_PARAMS) {
        fail(1, "line %d: too many params", line);
    }
    struct param *p = &tc->params[tc->nparams];
    memset(p, 0, sizeof *p);
    if (ntok < 3) {
        fail(1, "line %d: param needs a type and a value", line);
    }
    if (strcmp(tok[1], "tex") == 0 || strcmp(tok[1], "surf") == 0) {
        parse_object_param(tc, p, tok, ntok, line);
    } else if (strcmp(tok[1], "ptr") == 0) {
        p->kind = P_PTR;
        if (ntok < 5 || ntok > 6) {
            fail(1, "line %d: param ptr <elem> <count> init=<..> [check=<..>]", line);
        }
        p->is_ptr = 1;
        p->elem = parse_elem(tok[2]);
        if (p->elem == E_INVALID) {
            fail(1, "line %d: unknown element type '%s'", line, tok[2]);
        }
        p->count = (size_t)parse_uint(tok[3], line);
        if (p->count > MAX_BUFFER_BYTES / ELEM_SIZES[p->elem]) {
            fail(1, "line %d: buffer too large", line);
        }
        if (strcmp(tok[4], "init=zero") == 0) {
            p->init = I_ZERO;
        } else if (strcmp(tok[4], "init=iota") == 0) {
            p->init = I_IOTA;
        } else if (strcmp(tok[4], "init=random") == 0) {
            p->init = I_RANDOM;
        } else {
            fail(1, "line %d: bad init '%s'", line, tok[4]);
        }
        if (ntok == 6) {
            if (strncmp(tok[5], "check=", 6) != 0 || tok[5][6] == '\0') {
                fail(1, "line %d: bad check '%s'", line, tok[5]);
            }
            p->checked = 1;
        }
    } else {
        p->kind = P_SCALAR;
        if (ntok != 3) {
            fail(1, "line %d: param <type> <value>", line);
        }
        p->elem = parse_elem(tok[1]);
        switch (p->elem) {
        case E_U32: {
            unsigned long long v = parse_uint(tok[2], line);
            if (v > 0xffffffffull) {
                fail(1, "line %d: u32 out of range", line);
            }
            p->value.u32 = (uint32_t)v;
            break;
        }
        case E_S32: {
            long long v = parse_int(tok[2], line);
            if (v < INT32_MIN || v > INT32_MAX) {
                fail(1, "line %d: s32 out of range", line);
            }
            p->value.s32 = (int32_t)v;
            break;
        }
        case E_U64: p->value.u64 = (uint64_t)parse_uint(tok[2], line); break;
        case E_S64: p->value.s64 = (int64_t)parse_int(tok[2], line); break;
        case E_F32: p->value.f32 = (float)parse_float(tok[2], line); break;
        case E_F64: p->value.f64 = parse_float(tok[2], line); break;
        default: fail(1, "line %d: unsupported scalar type '%s'", line, tok[1]);
        }
    }
    tc->nparams++;
}

static void parse_case(const char *path, struct test_case *tc)
{
    memset(tc, 0, sizeof *tc);
    tc->grid[0] = tc->grid[1] = tc->grid[2] = 0;

    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    snprintf(tc->name, sizeof tc->name, "%s", base);
    char *dot = strstr(tc->name, ".case");
    if (dot) {
        *dot = '\0';
    }

    FILE *f = fopen(path, "r");
    if (!f) {
        fail(1, "cannot open: %s", strerror(errno));
    }
    char buf[MAX_LINE];
    int line = 0;
    while (fgets(buf, sizeof buf, f)) {
        line++;
        if (!strchr(buf, '\n') && !feof(f)) {
            fail(1, "line %d: too long", line);
        }
        char *hash = strchr(buf, '#');
        if (hash) {
            *hash = '\0';
        }
        char *tok[16];
        int ntok = split(buf, tok, 16);
        if (ntok < 0) {
            fail(1, "line %d: too many fields", line);
        }
        if (ntok == 0) {
            continue;
        }
        if (strcmp(tok[0], "ptx") == 0 && ntok == 2) {
            snprintf(tc->ptx, sizeof tc->ptx, "%s", tok[1]);
        } else if (strcmp(tok[0], "kernel") == 0 && ntok == 2) {
            snprintf(tc->kernel, sizeof tc->kernel, "%s", tok[1]);
        } else if (strcmp(tok[0], "grid") == 0) {
            parse_dim3(tok, ntok, tc->grid, line);
        } else if (strcmp(tok[0], "block") == 0) {
            parse_dim3(tok, ntok, tc->block, line);
        } else if (strcmp(tok[0], "shared") == 0 && ntok == 2) {
            unsigned long long v = parse_uint(tok[1], line);
            if (v > 0xffffffffull) {
                fail(1, "line %d: shared out of range", line);
            }
            tc->shared = (unsigned)v;
        } else if (strcmp(tok[0], "resource") == 0) {
            parse_resource(tc, tok, ntok, line);
        } else if (strcmp(tok[0], "param") == 0) {
            parse_param(tc, tok, ntok, line);
        } else {
            fail(1, "line %d: unknown directive '%s'", line, tok[0]);
        }
    }
    fclose(f);
    if (tc->ptx[0] == '\0' || tc->kernel[0] == '\0' || tc->grid[0] == 0 || tc->block[0] == 0) {
        fail(1, "missing ptx, kernel, grid or block");
    }
}

/* ---- data generation ---- */

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ull;
    }
    return h;
}

/* f32 -> f16 bits, round to nearest even, with subnormals, overflow to inf and NaN. */
static uint16_t f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xffu) {
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0u));
    }
    int e = (int)exp - 127 + 15;
    if (e >= 31) {
        return (uint16_t)(sign | 0x7c00u);
    }
    uint32_t m;
    int shift;
    uint32_t base;
    if (e <= 0) {
        if (e < -10) {
            return (uint16_t)sign;
        }
        m = man | 0x800000u;
        shift = 14 - e;
        base = 0;
    } else {
        m = man;
        shift = 13;
        base = (uint32_t)e << 10;
    }
    uint32_t h = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) {
        h++;
    }
    /* A carry out of the mantissa correctly bumps the exponent (up to inf). */
    return (uint16_t)(sign | (base + h));
}

static uint16_t f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((x >> 16) | 0x40u);
    }
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* Fills `count` elements of `elem` at `host` per `init`, from random stream `index` of the case. */
static void fill_elems(const struct test_case *tc, int index, enum elem elem, size_t count, enum init init,
                       void *host)
{
    size_t size = ELEM_SIZES[elem];
    uint64_t state = fnv1a(tc->name) ^ ((uint64_t)(index + 1) * 0x9e3779b97f4a7c15ull);
    unsigned char *out = (unsigned char *)host;
    for (size_t i = 0; i < count; i++) {
        unsigned char *dst = out + i * size;
        if (init == I_ZERO) {
            memset(dst, 0, size);
            continue;
        }
        uint64_t r = init == I_RANDOM ? splitmix64(&state) : (uint64_t)i;
        int random = init == I_RANDOM;
        switch (elem) {
        case E_U8:
        case E_S8: { uint8_t v = (uint8_t)r; memcpy(dst, &v, 1); break; }
        case E_U16:
        case E_S16: { uint16_t v = (uint16_t)r; memcpy(dst, &v, 2); break; }
        case E_U32:
        case E_S32: { uint32_t v = (uint32_t)r; memcpy(dst, &v, 4); break; }
        case E_U64:
        case E_S64: memcpy(dst, &r, 8); break;
        case E_F32: {
            float v = random ? (float)(r >> 40) * (1.0f / 8388608.0f) - 1.0f : (float)i;
            memcpy(dst, &v, 4);
            break;
        }
        case E_F64: {
            double v = random ? (double)(r >> 11) * (1.0 / 4503599627370496.0) - 1.0 : (double)i;
            memcpy(dst, &v, 8);
            break;
        }
        case E_F16: {
            float v = random ? (float)((int)(r >> 53) - 1024) / 1024.0f : (float)i;
            uint16_t h = f32_to_f16(v);
            memcpy(dst, &h, 2);
            break;
        }
        case E_BF16: {
            float v = random ? (float)((int)(r >> 56) - 128) / 128.0f : (float)i;
            uint16_t h = f32_to_bf16(v);
            memcpy(dst, &h, 2);
            break;
        }
        default: fail(1, "internal: bad element type");
        }
    }
}

static void fill(const struct test_case *tc, int index, struct param *p)
{
    fill_elems(tc, index, p->elem, p->count, p->init, p->host);
}

/* ---- files ---- */

static void write_named(const char *dir, const char *name, const char *ext, const void *data, size_t len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.%s", dir, name, ext);
    FILE *f = fopen(path, "wb");
    if (!f) {
        fail(1, "cannot create %s: %s", path, strerror(errno));
    }
    if (len > 0 && fwrite(data, 1, len, f) != len) {
        fail(1, "cannot write %s: %s", path, strerror(errno));
    }
    if (fclose(f) != 0) {
        fail(1, "cannot close %s: %s", path, strerror(errno));
    }
}

static void write_file(const char *dir, int index, const char *ext, const void *data, size_t len)
{
    char name[32];
    snprintf(name, sizeof name, "p%d", index);
    write_named(dir, name, ext, data, len);
}

/* ---- resources and objects ---- */

static CUarray_format array_format(enum elem e)
{
    switch (e) {
    case E_U8: return CU_AD_FORMAT_UNSIGNED_INT8;
    case E_U16: return CU_AD_FORMAT_UNSIGNED_INT16;
    case E_U32: return CU_AD_FORMAT_UNSIGNED_INT32;
    case E_S8: return CU_AD_FORMAT_SIGNED_INT8;
    case E_S16: return CU_AD_FORMAT_SIGNED_INT16;
    case E_S32: return CU_AD_FORMAT_SIGNED_INT32;
    case E_F16: return CU_AD_FORMAT_HALF;
    case E_F32: return CU_AD_FORMAT_FLOAT;
    default: fail(1, "internal: bad channel format");
    }
}

static size_t texel_bytes(const struct resource *r)
{
    return r->channels * ELEM_SIZES[r->elem];
}

/* The cuMemcpy3D between a dense host buffer and the array of `r`. */
static void array_copy(struct resource *r, int to_array)
{
    CUDA_MEMCPY3D c;
    memset(&c, 0, sizeof c);
    size_t row = r->width * texel_bytes(r);
    size_t rows = r->height ? r->height : 1;
    if (to_array) {
        c.srcMemoryType = CU_MEMORYTYPE_HOST;
        c.srcHost = r->host;
        c.srcPitch = row;
        c.srcHeight = rows;
        c.dstMemoryType = CU_MEMORYTYPE_ARRAY;
        c.dstArray = r->array;
    } else {
        c.srcMemoryType = CU_MEMORYTYPE_ARRAY;
        c.srcArray = r->array;
        c.dstMemoryType = CU_MEMORYTYPE_HOST;
        c.dstHost = r->host;
        c.dstPitch = row;
        c.dstHeight = rows;
    }
    c.WidthInBytes = row;
    c.Height = rows;
    /* Layers follow the slices: a layered 1D array is `layers` rows of one slice each. */
    c.Depth = r->layers ? r->layers : (r->depth ? r->depth : 1);
    check_cu(cuMemcpy3D(&c), to_array ? "cuMemcpy3D (to array)" : "cuMemcpy3D (from array)");
}

static void pitch_copy(struct resource *r, int to_device)
{
    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    size_t row = r->width * texel_bytes(r);
    if (to_device) {
        c.srcMemoryType = CU_MEMORYTYPE_HOST;
        c.srcHost = r->host;
        c.srcPitch = row;
        c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        c.dstDevice = r->dev;
        c.dstPitch = r->pitch;
    } else {
        c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
        c.srcDevice = r->dev;
        c.srcPitch = r->pitch;
        c.dstMemoryType = CU_MEMORYTYPE_HOST;
        c.dstHost = r->host;
        c.dstPitch = row;
    }
    c.WidthInBytes = row;
    c.Height = r->height;
    check_cu(cuMemcpy2D(&c), to_device ? "cuMemcpy2D (to device)" : "cuMemcpy2D (from device)");
}

static void create_resource(struct test_case *tc, int k, const char *data_dir)
{
    struct resource *r = &tc->resources[k];
    r->host = calloc(r->bytes ? r->bytes : 1, 1);
    if (!r->host) {
        fail(1, "out of memory");
    }
    fill_elems(tc, 1000 + k, r->elem, r->bytes / ELEM_SIZES[r->elem], r->init, r->host);
    write_named(data_dir, r->name, "in", r->host, r->bytes);
    switch (r->kind) {
    case R_ARRAY: {
        CUDA_ARRAY3D_DESCRIPTOR d;
        memset(&d, 0, sizeof d);
        d.Width = r->width;
        d.Height = r->height;
        d.Depth = r->layers ? r->layers : r->depth;
        d.Format = array_format(r->elem);
        d.NumChannels = r->channels;
        d.Flags = (r->layers ? CUDA_ARRAY3D_LAYERED : 0) | (r->surface ? CUDA_ARRAY3D_SURFACE_LDST : 0);
        check_cu(cuArray3DCreate(&r->array, &d), "cuArray3DCreate");
        array_copy(r, 1);
        break;
    }
    case R_LINEAR:
        /* Over-allocated so the start can honour the texture alignment (512 bytes covers every GPU). */
        check_cu(cuMemAlloc(&r->alloc, r->bytes + 512), "cuMemAlloc (linear texture)");
        r->dev = (r->alloc + 511) & ~(CUdeviceptr)511;
        check_cu(cuMemcpyHtoD(r->dev, r->host, r->bytes), "cuMemcpyHtoD (linear texture)");
        break;
    case R_PITCH2D: {
        size_t tb = texel_bytes(r);
        unsigned elem_size = tb >= 16 ? 16 : tb >= 8 ? 8 : 4;
        check_cu(cuMemAllocPitch(&r->alloc, &r->pitch, r->width * tb, r->height, elem_size), "cuMemAllocPitch");
        r->dev = r->alloc;
        pitch_copy(r, 1);
        break;
    }
    }
}

static void resource_desc(const struct resource *r, CUDA_RESOURCE_DESC *rd)
{
    memset(rd, 0, sizeof *rd);
    switch (r->kind) {
    case R_ARRAY:
        rd->resType = CU_RESOURCE_TYPE_ARRAY;
        rd->res.array.hArray = r->array;
        break;
    case R_LINEAR:
        rd->resType = CU_RESOURCE_TYPE_LINEAR;
        rd->res.linear.devPtr = r->dev;
        rd->res.linear.format = array_format(r->elem);
        rd->res.linear.numChannels = r->channels;
        rd->res.linear.sizeInBytes = r->bytes;
        break;
    case R_PITCH2D:
        rd->resType = CU_RESOURCE_TYPE_PITCH2D;
        rd->res.pitch2D.devPtr = r->dev;
        rd->res.pitch2D.format = array_format(r->elem);
        rd->res.pitch2D.numChannels = r->channels;
        rd->res.pitch2D.width = r->width;
        rd->res.pitch2D.height = r->height;
        rd->res.pitch2D.pitchInBytes = r->pitch;
        break;
    }
}

static void create_object(const struct test_case *tc, struct param *p)
{
    const struct resource *r = &tc->resources[p->tex.resource];
    CUDA_RESOURCE_DESC rd;
    resource_desc(r, &rd);
    if (p->kind == P_SURF) {
        check_cu(cuSurfObjectCreate(&p->surf_obj, &rd), "cuSurfObjectCreate");
        p->value.handle = (unsigned long long)p->surf_obj;
        return;
    }
    CUDA_TEXTURE_DESC td;
    memset(&td, 0, sizeof td);
    for (int d = 0; d < 3; d++) {
        td.addressMode[d] = p->tex.address[d];
    }
    td.filterMode = p->tex.filter;
    td.flags = (p->tex.read_as_integer ? CU_TRSF_READ_AS_INTEGER : 0) |
               (p->tex.normalized ? CU_TRSF_NORMALIZED_COORDINATES : 0);
    for (int k = 0; k < 4; k++) {
        td.borderColor[k] = p->tex.border[k];
    }
    check_cu(cuTexObjectCreate(&p->tex_obj, &rd, &td, NULL), "cuTexObjectCreate");
    p->value.handle = (unsigned long long)p->tex_obj;
}

static void read_back_resource(struct resource *r, const char *data_dir)
{
    switch (r->kind) {
    case R_ARRAY: array_copy(r, 0); break;
    case R_LINEAR: check_cu(cuMemcpyDtoH(r->host, r->dev, r->bytes), "cuMemcpyDtoH (resource)"); break;
    case R_PITCH2D: pitch_copy(r, 0); break;
    }
    write_named(data_dir, r->name, "out", r->host, r->bytes);
}

static void destroy_resource(struct resource *r)
{
    if (r->kind == R_ARRAY) {
        check_cu(cuArrayDestroy(r->array), "cuArrayDestroy");
    } else {
        check_cu(cuMemFree(r->alloc), "cuMemFree (resource)");
    }
    free(r->host);
}

static char *read_text(const char *path, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fail(1, "cannot open PTX %s: %s", path, strerror(errno));
    }
    if (fseek(f, 0, SEEK_END) != 0) {
        fail(1, "cannot seek %s", path);
    }
    long len = ftell(f);
    if (len < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fail(1, "cannot size %s", path);
    }
    char *buf = malloc((size_t)len + 1);
    if (!buf) {
        fail(1, "out of memory");
    }
    if (fread(buf, 1, (size_t)len, f) != (size_t)len) {
        fail(1, "cannot read %s", path);
    }
    buf[len] = '\0';
    fclose(f);
    *len_out = (size_t)len;
    return buf;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s <case file> <ptx dir> <data dir>\n", argv[0]);
        return 1;
    }
    case_path = argv[1];
    static struct test_case tc;
    parse_case(argv[1], &tc);

    const char *data_dir = argv[3];
    if (mkdir(data_dir, 0755) != 0 && errno != EEXIST) {
        fail(1, "cannot create %s: %s", data_dir, strerror(errno));
    }

    char ptx_path[1200];
    snprintf(ptx_path, sizeof ptx_path, "%s/%s", argv[2], tc.ptx);
    size_t ptx_len = 0;
    char *ptx = read_text(ptx_path, &ptx_len);
    if (ptx_len == 0 || strstr(ptx, ".entry") == NULL) {
        fail(1, "%s holds no PTX entry (placeholder?)", ptx_path);
    }

    check_cu(cuInit(0), "cuInit");
    CUdevice dev;
    check_cu(cuDeviceGet(&dev, 0), "cuDeviceGet");
    CUcontext ctx;
    check_cu(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check_cu(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");

    char error_log[8192] = {0};
    char info_log[8192] = {0};
    CUjit_option opts[4] = {
        CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
    };
    void *vals[4] = {
        error_log, (void *)(uintptr_t)sizeof error_log,
        info_log, (void *)(uintptr_t)sizeof info_log,
    };
    CUmodule module;
    CUresult r = cuModuleLoadDataEx(&module, ptx, 4, opts, vals);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "harness: %s: JIT error log:\n%s\n", case_path, error_log);
    }
    check_cu(r, "cuModuleLoadDataEx");
    CUfunction fn;
    r = cuModuleGetFunction(&fn, module, tc.kernel);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "harness: %s: kernel '%s' not in %s\n", case_path, tc.kernel, ptx_path);
    }
    check_cu(r, "cuModuleGetFunction");

    for (int k = 0; k < tc.nresources; k++) {
        create_resource(&tc, k, data_dir);
    }
    void *kernel_params[MAX_PARAMS];
    for (int i = 0; i < tc.nparams; i++) {
        struct param *p = &tc.params[i];
        if (p->kind == P_TEX || p->kind == P_SURF) {
            create_object(&tc, p);
        } else if (p->is_ptr) {
            size_t bytes = p->count * ELEM_SIZES[p->elem];
            p->host = calloc(bytes ? bytes : 1, 1);
            if (!p->host) {
                fail(1, "out of memory");
            }
            fill(&tc, i, p);
            check_cu(cuMemAlloc(&p->dev, bytes ? bytes : 1), "cuMemAlloc");
            if (bytes) {
                check_cu(cuMemcpyHtoD(p->dev, p->host, bytes), "cuMemcpyHtoD");
            }
            write_file(data_dir, i, "in", p->host, bytes);
            p->value.ptr = p->dev;
        }
        kernel_params[i] = &p->value;
    }

    if (tc.shared > 48u * 1024u) {
        check_cu(cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)tc.shared),
                 "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
    }
    check_cu(cuLaunchKernel(fn, tc.grid[0], tc.grid[1], tc.grid[2], tc.block[0], tc.block[1], tc.block[2],
                            tc.shared, NULL, kernel_params, NULL),
             "cuLaunchKernel");
    check_cu(cuCtxSynchronize(), "cuCtxSynchronize (kernel execution)");

    for (int i = 0; i < tc.nparams; i++) {
        struct param *p = &tc.params[i];
        if (!p->is_ptr || !p->checked) {
            continue;
        }
        size_t bytes = p->count * ELEM_SIZES[p->elem];
        if (bytes) {
            check_cu(cuMemcpyDtoH(p->host, p->dev, bytes), "cuMemcpyDtoH");
        }
        write_file(data_dir, i, "out", p->host, bytes);
    }
    for (int k = 0; k < tc.nresources; k++) {
        if (tc.resources[k].checked) {
            read_back_resource(&tc.resources[k], data_dir);
        }
    }
    for (int i = 0; i < tc.nparams; i++) {
        if (tc.params[i].is_ptr) {
            check_cu(cuMemFree(tc.params[i].dev), "cuMemFree");
            free(tc.params[i].host);
        } else if (tc.params[i].kind == P_TEX) {
            check_cu(cuTexObjectDestroy(tc.params[i].tex_obj), "cuTexObjectDestroy");
        } else if (tc.params[i].kind == P_SURF) {
            check_cu(cuSurfObjectDestroy(tc.params[i].surf_obj), "cuSurfObjectDestroy");
        }
    }
    for (int k = 0; k < tc.nresources; k++) {
        destroy_resource(&tc.resources[k]);
    }
    check_cu(cuModuleUnload(module), "cuModuleUnload");
    check_cu(cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease");
    free(ptx);
    printf("ok %s: %s<<<(%u,%u,%u),(%u,%u,%u),%u>>> %d params, %d resources\n", tc.name, tc.kernel,
           tc.grid[0], tc.grid[1], tc.grid[2], tc.block[0], tc.block[1], tc.block[2], tc.shared, tc.nparams,
           tc.nresources);
    return 0;
}
