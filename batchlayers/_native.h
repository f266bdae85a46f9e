/* What batchlayers' C kernels share (see batchlayers/_native.py, which compiles them into one library). */
#ifndef BATCHLAYERS_NATIVE_H
#define BATCHLAYERS_NATIVE_H

/* A function's loops built for AVX-512, for AVX2 with FMA and for the baseline, the best one picked when the
 * library loads: the kernels' loops vectorise for the machine they run on, and fmaf is one instruction. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

#endif
