/* Fused RoPE re-rotation for the CPU: one read and one write of every key element.
 *
 * Keys already rotated to positions p are moved to p + delta by rotating each pair by delta * inv_freq
 * (rotations compose). src and dst may be the same buffer (in place). Shapes, all row-major with the
 * last dimension contiguous:
 *   src, dst  (rows, n, D), given by element strides (row stride, token stride)
 *   cos, sin  (n, D/2) float32, token stride cs_stride (0 = one angle for every token)
 * Pairs: neox = (i, i + D/2); interleaved = (2i, 2i + 1). The math is float32 for every storage type.
 * Compiled at first use by kernels/rerotate.py (gcc -O3 -march=native -fopenmp); the torch reference
 * in kernels/rope.py is the ground truth it is tested against.
 */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define ROTATE_BODY(LOAD, STORE)                                                           \
    _Pragma("omp parallel for schedule(static)")                                           \
    for (int64_t idx = 0; idx < rows * n; idx++) {                                         \
        int64_t r = idx / n, t = idx % n;                                                  \
        const float *c = cos_ + t * cs_stride, *s = sin_ + t * cs_stride;                  \
        int64_t so = r * src_row + t * src_tok, dof = r * dst_row + t * dst_tok;           \
        int64_t half = d / 2;                                                              \
        if (interleaved) {                                                                 \
            for (int64_t i = 0; i < half; i++) {                                           \
                float x1 = LOAD(src[so + 2 * i]), x2 = LOAD(src[so + 2 * i + 1]);          \
                dst[dof + 2 * i] = STORE(x1 * c[i] - x2 * s[i]);                           \
                dst[dof + 2 * i + 1] = STORE(x2 * c[i] + x1 * s[i]);                       \
            }                                                                              \
        } else {                                                                           \
            for (int64_t i = 0; i < half; i++) {                                           \
                float x1 = LOAD(src[so + i]), x2 = LOAD(src[so + half + i]);               \
                dst[dof + i] = STORE(x1 * c[i] - x2 * s[i]);                               \
                dst[dof + half + i] = STORE(x2 * c[i] + x1 * s[i]);                        \
            }                                                                              \
        }                                                                                  \
    }

#define ARGS                                                                                 \
    int64_t rows, int64_t n, int64_t d, int64_t src_row, int64_t src_tok, int64_t dst_row,  \
        int64_t dst_tok, const float *cos_, const float *sin_, int64_t cs_stride, int interleaved

#define ID(x) (x)

void rerotate_f32(const float *src, float *dst, ARGS) { ROTATE_BODY(ID, ID) }

void rerotate_bf16(const uint16_t *src, uint16_t *dst, ARGS) { ROTATE_BODY(bf16_to_f32, f32_to_bf16) }

void rerotate_f16(const _Float16 *src, _Float16 *dst, ARGS) { ROTATE_BODY((float), (_Float16)) }
