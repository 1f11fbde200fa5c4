/* The call sequence, recorded from the assembly stubs: general registers only (built with
 * -mgeneral-regs-only) and no libc, so the driver call's arguments pass through untouched. */
#define CAP (1 << 20)
__attribute__((visibility("hidden"))) unsigned spy_seq[CAP];
__attribute__((visibility("hidden"))) unsigned long spy_nseq;
__attribute__((visibility("hidden"))) void spy_note(unsigned i) {
    unsigned long pos = __atomic_fetch_add(&spy_nseq, 1, __ATOMIC_RELAXED);
    if (pos < CAP) spy_seq[pos] = i;
}
