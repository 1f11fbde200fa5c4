#!/usr/bin/env bash
# Generates a pass-through libcuda.so.1 that forwards every export of NVIDIA's driver and spies on the
# slots of chosen export tables (spy.c). Run on the GPU machine:
#   bash tools/gpu/table_spy/gen.sh /path/to/exports.txt OUTDIR   -> OUTDIR/libcuda.so.1
# then run a program with LD_LIBRARY_PATH=OUTDIR SPY_LOG=file [SPY_TABLES=69a28e9f,...] [SPY_REAL=path].
set -eu
exports=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
overridden=" cuGetExportTable cuGetProcAddress cuGetProcAddress_v2 "
{
    echo '.section .note.GNU-stack,"",@progbits'; echo '.text'
    i=0
    while read -r sym; do
        case "$overridden" in *" $sym "*) continue ;; esac
        # Note the call (spy_note: general registers only, no libc), then jump to the driver.
        printf '.globl %s\n.type %s,@function\n%s:\n' "$sym" "$sym" "$sym"
        printf '  push %%rdi\n  push %%rsi\n  push %%rdx\n  push %%rcx\n  push %%r8\n  push %%r9\n  push %%rax\n'
        printf '  mov $%d, %%edi\n  call spy_note\n' $i
        printf '  pop %%rax\n  pop %%r9\n  pop %%r8\n  pop %%rcx\n  pop %%rdx\n  pop %%rsi\n  pop %%rdi\n'
        printf '  jmp *spy_ptrs+%d(%%rip)\n' $((i * 8))
        i=$((i + 1))
    done < "$exports"
} > "$out/stubs.S"
{
    echo 'static const char *const SPY_NAMES[] = {'
    while read -r sym; do
        case "$overridden" in *" $sym "*) continue ;; esac
        printf '  "%s",\n' "$sym"
    done < "$exports"
    echo '};'
} > "$out/names.h"
gcc -O1 -fPIC -mgeneral-regs-only -c -o "$out/note.o" "$here/note.c"
gcc -O1 -shared -fPIC -I"$out" -o "$out/libcuda.so.1" "$here/spy.c" "$out/note.o" "$out/stubs.S" -ldl -Wl,-soname,libcuda.so.1
echo "built $out/libcuda.so.1"
