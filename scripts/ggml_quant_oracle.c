// The oracle of reference/src/gguf/arith.rs's activation round trips: calls ggml's own quantizers (llama.cpp's x86
// `quantize_row_q8_0` and `quantize_row_q8_1` from ggml-cpu/arch/x86/quants.c, and `quantize_row_q8_K_ref`, which the
// x86 `quantize_row_q8_K` calls) on deterministic rows and prints the FNV-1a hash of the dequantized values' f32 bits,
// `f16(d) * q` (Q8_0, Q8_1) and `d * q` (Q8_K), which the unit test
// `the_round_trips_equal_ggmls_own_x86_quantizers_bit_for_bit` pins. Not part of the crates; built by hand against a
// llama.cpp tree (the commit of testdata/gguf/README.md), no library needed:
//
//   G=/tmp/llama.cpp/ggml; F="-O2 -march=native -std=gnu11 -D_GNU_SOURCE -I$G/include -I$G/src -I$G/src/ggml-cpu"
//   gcc $F -c $G/src/ggml-cpu/arch/x86/quants.c -o x86quants.o && gcc $F -c $G/src/ggml-quants.c -o quants.o
//   gcc $F -c scripts/ggml_quant_oracle.c -o oracle.o
//   gcc -no-pie oracle.o x86quants.o quants.o -o oracle -lm -Wl,--unresolved-symbols=ignore-all && ./oracle
//
// (on an x86 CPU with AVX2: the x86 quantizers' SIMD path; the unresolved symbols belong to dot products never called).
#include "ggml-common.h"
#include "ggml-quants.h"
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

void quantize_row_q8_0(const float * x, void * y, int64_t k);
void quantize_row_q8_1(const float * x, void * y, int64_t k);
float ggml_table_f32_f16[1 << 16];

static uint64_t state;

// xorshift64; a value in [-1, 1).
static float next_value(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (float) ((double) (state >> 40) / (double) (1u << 24)) * 2.0f - 1.0f;
}

static uint64_t fnv(uint64_t h, float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    for (int i = 0; i < 4; i++) {
        h ^= (bits >> (8 * i)) & 0xff;
        h *= 0x100000001b3ULL;
    }
    return h;
}

int main(void) {
    enum { N = 4096 };
    static float x[N];
    static block_q8_0 q0[N / 32];
    static block_q8_1 q1[N / 32];
    static block_q8_K qk[N / 256];
    uint64_t h0 = 0xcbf29ce484222325ULL, h1 = h0, hk = h0;
    // 16 rows: scales 1e-6 (f16(d) subnormal), 3e-3, 1e4, then 0.37 * row; row 3 starts with a zero Q8_K block, row 4
    // holds half-integer codes (exact ties).
    for (int row = 0; row < 16; row++) {
        state = 0x9E3779B97F4A7C15ULL * (uint64_t) (row + 1) | 1;
        const float scale = row == 0 ? 1e-6f : row == 1 ? 3e-3f : row == 2 ? 1e4f : (float) row * 0.37f;
        for (int i = 0; i < N; i++) {
            x[i] = next_value() * scale;
        }
        if (row == 3) {
            memset(x, 0, 256 * sizeof(float));
        }
        if (row == 4) {
            for (int i = 0; i < N; i++) {
                x[i] = (float) ((i % 255) - 127) * 0.5f;
            }
        }
        quantize_row_q8_0(x, q0, N);
        quantize_row_q8_1(x, q1, N);
        quantize_row_q8_K_ref(x, qk, N);
        for (int b = 0; b < N / 32; b++) {
            for (int j = 0; j < 32; j++) {
                h0 = fnv(h0, _cvtsh_ss(q0[b].d) * (float) q0[b].qs[j]);
                h1 = fnv(h1, _cvtsh_ss(q1[b].d) * (float) q1[b].qs[j]);
            }
        }
        for (int b = 0; b < N / 256; b++) {
            for (int j = 0; j < 256; j++) {
                hk = fnv(hk, qk[b].d * (float) qk[b].qs[j]);
            }
        }
        if (row == 5) {
            printf("row 5: q8_0 d=%04x q=%d %d %d %d; q8_K d=%a q=%d %d %d %d\n", q0[0].d, q0[0].qs[0], q0[0].qs[1],
                   q0[0].qs[2], q0[0].qs[3], qk[0].d, qk[0].qs[0], qk[0].qs[1], qk[0].qs[2], qk[0].qs[3]);
        }
    }
    printf("q8_0 %016llx\nq8_1 %016llx\nq8_K %016llx\n", (unsigned long long) h0, (unsigned long long) h1,
           (unsigned long long) hk);
    return 0;
}
