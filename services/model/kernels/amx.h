/*
 * What the AMX kernels share (amx_linear.c, paged_attention.c): whether the build has AMX
 * (the compiler and -march=native's CPU), the permission a process needs before it touches
 * tiles, and a thread's tile configuration. Included by each kernel's source;
 * kernels/__init__.py hashes it with them.
 */
#ifndef PDSERVE_AMX_H
#define PDSERVE_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h's, which would need _GNU_SOURCE (and its select) */

/* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the kernel must allow AMX's state (once a
 * process; 1 if it did). */
static inline int amx_permitted(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* This thread's tiles 0 .. count-1: tile t holds rows[t] rows of colsb[t] bytes (palette 1). */
static inline void amx_configure_tiles(int count, const int *rows, const int *colsb) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < count; t++) c.rows[t] = (uint8_t)rows[t], c.colsb[t] = (uint16_t)colsb[t];
    /* GCC 12 does not count the instruction as reading c: with eight tiles configured it
     * dropped the stores above, and the instruction faulted on an invalid configuration */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#else
#define HAVE_AMX 0
#endif

#endif
