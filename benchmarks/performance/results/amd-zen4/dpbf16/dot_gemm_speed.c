#include "../../../../../src/difftx/nn/cpu_kernels.c"
#include <time.h>
#include <stdio.h>
static double now(void){struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
int main(void){
  int64_t shapes[][3] = {{64,512,64},{64,64,512},{64,512,64},{512,512,64},{64,512,512}};
  for (int s=0;s<5;s++){
    int64_t M=shapes[s][0],N=shapes[s][1],K=shapes[s][2];
    uint16_t *A=aligned_alloc(64,M*K*2), *B=aligned_alloc(64,N*K*2); float *C=aligned_alloc(64,M*N*4);
    for(int64_t i=0;i<M*K;i++)A[i]=0x3f80; for(int64_t i=0;i<N*K;i++)B[i]=0x3f80;
    int reps = (int)(2e9/(2.0*M*N*K));
    dot_gemm(M,N,K,A,K,B,K/32,C,N,0,-1,-1);
    double t=now();
    for(int r=0;r<reps;r++) dot_gemm(M,N,K,A,K,B,K/32,C,N,s==2,-1,-1);
    t=now()-t;
    printf("M=%ld N=%ld K=%ld acc=%d: %.1f GFLOP/s\n",M,N,K,s==2,2.0*M*N*K*reps/t/1e9);
  }
}
