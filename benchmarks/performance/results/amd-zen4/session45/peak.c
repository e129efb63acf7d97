/* One core's arithmetic peaks, registers only (no loads): 16 independent accumulators per loop, so neither
 * latency nor memory limits them.  vdpbf16ps zmm (the bf16 products without AMX: 16 lanes x 2 pairs x 2 flops)
 * against vfmadd231ps zmm (float32: 16 lanes x 2 flops).
 *
 *     gcc -O2 -march=native peak.c -o peak && ./peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define R(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

int main(void) {
    const long reps = 100000000;
    for (int round = 0; round < 3; round++) {
#define D(i) __m512 c##i = _mm512_set1_ps(i); __asm__ volatile("" : "+v"(c##i));
        R(D)
        __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
        double t = now();
        for (long r = 0; r < reps; r++) {
#define S(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
            R(S)
            __asm__ volatile("" : "+v"(a), "+v"(b));
        }
        const double tb = now() - t;
#define A(i) +_mm512_reduce_add_ps(c##i)
        const float sb = 0 R(A);
#define F(i) __m512 f##i = _mm512_set1_ps(i); __asm__ volatile("" : "+v"(f##i));
        R(F)
        __m512 x = _mm512_set1_ps(1e-9f), y = _mm512_set1_ps(1.0f);
        t = now();
        for (long r = 0; r < reps; r++) {
#define G(i) f##i = _mm512_fmadd_ps(x, y, f##i);
            R(G)
            __asm__ volatile("" : "+v"(x), "+v"(y));
        }
        const double tf = now() - t;
#define B(i) +_mm512_reduce_add_ps(f##i)
        const float sf = 0 R(B);
        const double pb = 64.0 * 16 * reps / tb / 1e9, pf = 32.0 * 16 * reps / tf / 1e9;
        printf("round %d: vdpbf16ps %.1f GFLOP/s, vfmadd231ps %.1f GFLOP/s, ratio %.3f (%g %g)\n", round, pb, pf,
               pb / pf, sb, sf);
    }
    return 0;
}
