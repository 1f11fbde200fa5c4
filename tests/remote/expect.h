/* The checks the newer tests/remote programs share: EXPECT(call, want) exits 10 when a driver call does
 * not return `want`, CHECK(cond, fmt, ...) exits 11 when a condition fails, each after one FAIL line.
 * Include after `CUresult` and `cuGetErrorName` are declared (and <stdio.h>, <stdlib.h>). */
#ifndef GLEAM_TEST_EXPECT_H
#define GLEAM_TEST_EXPECT_H

static const char *name_of(CUresult r) {
    const char *name = "?";
    cuGetErrorName(r, &name);
    return name;
}

#define EXPECT(call, want)                                                                  \
    do {                                                                                    \
        CUresult got_ = (call);                                                             \
        if (got_ != (want)) {                                                               \
            printf("FAIL %s: got %s (%d), want %d\n", #call, name_of(got_), got_, (want)); \
            fflush(stdout);                                                                 \
            exit(10);                                                                       \
        }                                                                                   \
    } while (0)

#define CHECK(cond, ...)                \
    do {                                \
        if (!(cond)) {                  \
            printf("FAIL %s: ", #cond); \
            printf(__VA_ARGS__);        \
            printf("\n");               \
            fflush(stdout);             \
            exit(11);                   \
        }                               \
    } while (0)

#endif
