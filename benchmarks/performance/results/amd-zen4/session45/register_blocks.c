/* The bf16 dot-product register block's shape, hot in cache: dot_block's 8 rows x 32 columns (16 accumulators,
 * 8 broadcasts per 16 vdpbf16ps) against other shapes, on dot_linear's loop order (tasks of 48 rows here, so
 * that every shape tiles them; B packed as the kernels pack it).  All ones in bf16; GFLOP/s of whole products.
 *
 *     gcc -O3 -march=native -mprefer-vector-width=512 register_blocks.c -o register_blocks && ./register_blocks
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define TILE 512
static double now(void){struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
/* MR rows x (16*NV) cols; B: strips of 16 cols, strip s at b + s*kstride*TILE; tile kk at + kk*TILE; row r (pair) at + r*32 */
#define DEF(MR, NV) \
static inline __attribute__((always_inline)) void blk_##MR##_##NV(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t kstride, int64_t kt, float *c, int64_t ldc) { \
    __m512 acc[MR][NV]; \
    for (int m = 0; m < MR; m++) for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps(); \
    for (int64_t kk = 0; kk < kt; kk++) { \
        const uint16_t *ak = a + kk * 32; \
        for (int r = 0; r < 16; r++) { \
            __m512bh bv[NV]; \
            for (int v = 0; v < NV; v++) bv[v] = (__m512bh)_mm512_loadu_si512(b + (v * kstride + kk) * TILE + r * 32); \
            for (int m = 0; m < MR; m++) { \
                int32_t pair; memcpy(&pair, ak + m * lda + 2 * r, 4); \
                const __m512bh u = (__m512bh)_mm512_set1_epi32(pair); \
                for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], u, bv[v]); \
            } \
        } \
    } \
    for (int m = 0; m < MR; m++) for (int v = 0; v < NV; v++) _mm512_storeu_ps(c + m * ldc + v * 16, acc[m][v]); \
} \
static void gemm_##MR##_##NV(int64_t M, int64_t N, int64_t K, const uint16_t *A, const uint16_t *B, float *C) { \
    const int64_t kt = K / 32; \
    for (int64_t i0 = 0; i0 < M; i0 += 48) \
    for (int64_t j = 0; j + 16 * NV <= N; j += 16 * NV) \
        for (int64_t i = i0; i + MR <= i0 + 48 && i + MR <= M; i += MR) \
            blk_##MR##_##NV(A + i * K, K, B + (j / 16) * kt * TILE, kt, kt, C + i * N + j, N); \
}
DEF(8, 2)
DEF(4, 4)
DEF(6, 3)
DEF(8, 3)
DEF(12, 2)
DEF(4, 2)
DEF(6, 4)
int main(int argc, char **argv){
  int64_t shapes[][3] = {{192,768,512},{192,768,1408},{1920,512,512}};
  for (int s=0;s<3;s++){
    int64_t M=shapes[s][0],N=shapes[s][1],K=shapes[s][2];
    uint16_t *A=aligned_alloc(64,M*K*2), *B=aligned_alloc(64,N*K*2); float *C=aligned_alloc(64,M*N*4);
    for(int64_t i=0;i<M*K;i++)A[i]=0x3f80; for(int64_t i=0;i<N*K;i++)B[i]=0x3f80;
    int reps = (int)(4e9/(2.0*M*N*K));
#define RUN(MR,NV) { gemm_##MR##_##NV(M,N,K,A,B,C); double t=now(); for(int r=0;r<reps;r++) gemm_##MR##_##NV(M,N,K,A,B,C); t=now()-t; \
      int64_t n_eff = N / (16*NV) * (16*NV); int64_t m_eff = M; \
      printf("M=%ld N=%ld K=%ld blk %2dx%2d: %.1f GFLOP/s\n",M,N,K,MR,16*NV,2.0*m_eff*n_eff*K*reps/t/1e9); }
    RUN(8,2) RUN(4,4) RUN(6,3) RUN(8,3) RUN(12,2) RUN(6,4) RUN(4,2)
  }
}
