// conv1d (stride 1, groups 1, fp16/bf16) as an implicit GEMM on mma.sync, one persistent program
// per SM walking the batch elements; each element's input and output move by one bulk copy (the
// copy engine), the weights and bias are read once per program:
//
//   x[n] (contiguous Cin x L) --bulk copy--> xin  --8x8 transposes--> slab [position][Cin + 8]
//   slab rows shifted by tap k * dilation --ldmatrix--> mma.sync B operands; weights (A) resident
//   accumulators + bias --> yout [Cout][Lout] --bulk copy--> y[n] (contiguous)
//
// In the slab a tap's shift is a shift by whole rows; the row stride, an odd number of 16-byte
// units, keeps every ldmatrix conflict-free at any shift. The next elements' inputs are in flight
// (IN_BUFS of them) and the previous output drains while the tensor cores work.
//
// Compile-time constants (-D, from conv1d_bulk.py): CIN COUT L LOUT KT PAD DIL (the convolution),
// WARPS_M x WARPS_N warps with M_TILES m16 x N_TILES n8 tiles each, IN_BUFS, HAS_BIAS, DTYPE_BF16.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#if DTYPE_BF16
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
#define MMA_AB "bf16"
__device__ __forceinline__ T2 pack2(float a, float b) { return __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ float tofloat(T v) { return __bfloat162float(v); }
#else
typedef __half T;
typedef __half2 T2;
#define MMA_AB "f16"
__device__ __forceinline__ T2 pack2(float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ float tofloat(T v) { return __half2float(v); }
#endif

constexpr int RS = CIN + 8;                       // slab and weight row stride (elements)
constexpr int NPOS = WARPS_N * N_TILES * 8;       // output positions computed per element
constexpr int ROWS = NPOS + (KT - 1) * DIL;       // slab rows: row r <-> input position r - PAD
constexpr int THREADS = WARPS_M * WARPS_N * 32;
constexpr int CB = CIN / 8, PB = L / 8;           // 16-byte channel / position blocks
constexpr int X_BYTES = CIN * L * 2, Y_BYTES = COUT * LOUT * 2;
constexpr int W_ELEMS = KT * COUT * RS, S_ELEMS = ROWS * RS;
static_assert(CIN % 16 == 0, "Cin must be a multiple of 16");
static_assert(L % 8 == 0 && LOUT % 2 == 0 && Y_BYTES % 16 == 0, "bulk copies move 16-byte units");
static_assert(WARPS_M * M_TILES * 16 == COUT, "warps x m16 tiles must cover Cout");
static_assert(NPOS >= LOUT && ROWS >= L + PAD, "warps x n8 tiles must cover Lout");
static_assert((COUT * CIN * KT) % 8 == 0, "weights load as 16-byte vectors");

__device__ __forceinline__ uint32_t sptr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(sptr(p)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t& r0, uint32_t& r1, const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(sptr(p)));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sptr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sptr(dst)), "l"(src), "r"(bytes), "r"(sptr(bar)) : "memory");
}
__device__ __forceinline__ void wait_phase(uint64_t* bar, uint32_t phase) {
  asm volatile("{\n .reg .pred p;\n WAIT%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT%=;\n}"
               :: "r"(sptr(bar)), "r"(phase) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
conv1d_bulk(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
            T* __restrict__ y, int N) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw);           // IN_BUFS mbarriers
  T* ws = reinterpret_cast<T*>(smem_raw + 16 * IN_BUFS);             // [KT][COUT][RS]
  T* xs = ws + W_ELEMS;                                               // [ROWS][RS]
  T* xin = xs + S_ELEMS;                                              // IN_BUFS x [CIN][L]
  T* yout = xin + IN_BUFS * CIN * L;                                  // [COUT][LOUT]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  if (tid == 0) {
    for (int b = 0; b < IN_BUFS; ++b)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sptr(bars + 2 * b)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_async_smem();
  }
  __syncthreads();
  if (tid == 0)
    for (int b = 0; b < IN_BUFS; ++b) {
      const int n = blockIdx.x + b * gridDim.x;
      if (n < N) bulk_load(xin + b * CIN * L, x + static_cast<size_t>(n) * CIN * L, X_BYTES, bars + 2 * b);
    }

  // Weights w[co][ci][k] -> ws[k][co][ci], once per program.
  for (int v = tid; v < COUT * CIN * KT / 8; v += THREADS) {
    uint4 q = __ldg(reinterpret_cast<const uint4*>(w) + v);
    const T* e = reinterpret_cast<const T*>(&q);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      int f = v * 8 + j, co = f / (CIN * KT), rest = f % (CIN * KT), ci = rest / KT, k = rest % KT;
      ws[(k * COUT + co) * RS + ci] = e[j];
    }
  }
  // Slab rows outside the input are the zero padding: written once, never copied over.
  for (int i = tid; i < (ROWS - L) * CB; i += THREADS) {
    int r = i / CB, cb = i % CB;
    int row = r < PAD ? r : r + L;
    *reinterpret_cast<uint4*>(xs + row * RS + cb * 8) = make_uint4(0, 0, 0, 0);
  }
  const int wm = warp % WARPS_M, wn = warp / WARPS_M;
  const int co0 = wm * M_TILES * 16, l0 = wn * N_TILES * 8;
  const int g = lane >> 2, t = lane & 3;
  float bv[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    bv[mt][0] = HAS_BIAS ? tofloat(bias[co0 + mt * 16 + g]) : 0.f;
    bv[mt][1] = HAS_BIAS ? tofloat(bias[co0 + mt * 16 + g + 8]) : 0.f;
  }

  int iter = 0;
  for (int n = blockIdx.x; n < N; n += gridDim.x, ++iter) {
    const int buf = iter % IN_BUFS;
    const T* in = xin + buf * CIN * L;
    wait_phase(bars + 2 * buf, (iter / IN_BUFS) & 1);
    // 8x8 blocks (8 channels x 8 positions): 16-byte reads along positions, byte-permute
    // transpose, 16-byte writes along channels. The diagonal (cb = q + pb) keeps both sides
    // nearly free of bank conflicts.
    for (int it = tid; it < CB * PB; it += THREADS) {
      const int pb = it % PB, cb = (it / PB + pb) % CB;
      uint4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = *reinterpret_cast<const uint4*>(in + (cb * 8 + i) * L + pb * 8);
      const uint32_t* u = reinterpret_cast<const uint32_t*>(v);  // u[i*4 + p/2]: channel i, positions p, p+1
#pragma unroll
      for (int p = 0; p < 8; ++p) {
        const uint32_t sel = (p & 1) ? 0x7632u : 0x5410u;
        uint4 o;
        o.x = __byte_perm(u[0 * 4 + p / 2], u[1 * 4 + p / 2], sel);
        o.y = __byte_perm(u[2 * 4 + p / 2], u[3 * 4 + p / 2], sel);
        o.z = __byte_perm(u[4 * 4 + p / 2], u[5 * 4 + p / 2], sel);
        o.w = __byte_perm(u[6 * 4 + p / 2], u[7 * 4 + p / 2], sel);
        *reinterpret_cast<uint4*>(xs + (PAD + pb * 8 + p) * RS + cb * 8) = o;
      }
    }
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // yout drained
    __syncthreads();  // slab ready; xin[buf] consumed; yout free
    if (tid == 0) {
      const int nn = n + IN_BUFS * gridDim.x;
      fence_async_smem();
      if (nn < N) bulk_load(xin + buf * CIN * L, x + static_cast<size_t>(nn) * CIN * L, X_BYTES, bars + 2 * buf);
    }

    float acc[M_TILES][N_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll
    for (int k = 0; k < KT; ++k) {
#pragma unroll
      for (int kc = 0; kc < CIN / 16; ++kc) {
        uint32_t a[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
          ldsm_x4(a[mt], ws + (k * COUT + co0 + mt * 16 + (lane & 15)) * RS + kc * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int nt = 0; nt + 1 < N_TILES; nt += 2) {
          uint32_t b[4];
          ldsm_x4(b, xs + (l0 + nt * 8 + (lane >> 4) * 8 + (lane & 7) + k * DIL) * RS + kc * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
            mma(acc[mt][nt], a[mt], b[0], b[1]);
            mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
          }
        }
        if (N_TILES % 2) {
          constexpr int nt = N_TILES - 1;
          uint32_t b0, b1;
          ldsm_x2(b0, b1, xs + (l0 + nt * 8 + (lane & 7) + k * DIL) * RS + kc * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) mma(acc[mt][nt], a[mt], b0, b1);
        }
      }
    }

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt) {
        const int l = l0 + nt * 8 + 2 * t, co = co0 + mt * 16 + g;
        if (l < LOUT) {
          *reinterpret_cast<T2*>(yout + co * LOUT + l) = pack2(acc[mt][nt][0] + bv[mt][0], acc[mt][nt][1] + bv[mt][0]);
          *reinterpret_cast<T2*>(yout + (co + 8) * LOUT + l) = pack2(acc[mt][nt][2] + bv[mt][1], acc[mt][nt][3] + bv[mt][1]);
        }
      }
    fence_async_smem();
    __syncthreads();  // yout written; every warp is past its slab reads
    if (tid == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(y + static_cast<size_t>(n) * COUT * LOUT), "r"(sptr(yout)), "r"(Y_BYTES) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
