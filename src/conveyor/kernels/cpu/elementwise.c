/* The per-token elementwise chain of a decoder layer on the CPU, one pass each instead of torch's
 * 3-16 small ops (each a dispatch, an allocation and a pass over the tensor):
 *   rms_norm:     out = w * x / sqrt(mean(x^2) + eps) per row (float32 statistics, as transformers);
 *   rotary_:      x <- x cos + rotate_half(x) sin in place, per token and head, rotate_half pairing
 *                 element i with i + d/2 (HF's convention; cos/sin [T, d] hold both halves);
 *   silu_and_mul: out = silu(gate) * up for gate_up = [gate | up] per row.
 * Rows may be strided (q and k are views into the fused qkv output). Results equal the torch
 * formulas up to float32 summation order (rms_norm) and the polynomial exp (silu, ~1 ulp).
 */
#include <math.h>

#include "vec.h"

#define PARALLEL_ROWS 64  /* fewer rows than this run on the calling thread */

void rms_norm(const float* x, int64_t rows, int64_t cols, int64_t row_stride, const float* w, float eps,
              float* out, int num_threads) {
  #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * row_stride;
    float* o = out + r * cols;
    v16f squares = (v16f){0};
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) squares += load16(xr + c) * load16(xr + c);
    float sum = 0.0f;
    for (int i = 0; i < 16; i++) sum += squares[i];
    for (; c < cols; c++) sum += xr[c] * xr[c];
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    for (c = 0; c + 16 <= cols; c += 16) {
      const v16f y = load16(w + c) * (load16(xr + c) * inv);
      memcpy(o + c, &y, sizeof y);
    }
    for (; c < cols; c++) o[c] = w[c] * (xr[c] * inv);
  }
}

/* x: tokens [T] x heads [H] x d, token stride `token_stride`, head stride d (contiguous heads). */
void rotary_(float* x, int64_t tokens, int64_t heads, int64_t d, int64_t token_stride, const float* cos,
             const float* sin, int num_threads) {
  const int64_t half = d / 2;
  #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
  for (int64_t t = 0; t < tokens; t++) {
    const float* ct = cos + t * d;
    const float* st = sin + t * d;
    for (int64_t h = 0; h < heads; h++) {
      float* xh = x + t * token_stride + h * d;
      int64_t i = 0;
      for (; i + 16 <= half; i += 16) {
        const v16f a = load16(xh + i), b = load16(xh + half + i);
        const v16f lo = a * load16(ct + i) - b * load16(st + i);
        const v16f hi = b * load16(ct + half + i) + a * load16(st + half + i);
        memcpy(xh + i, &lo, sizeof lo), memcpy(xh + half + i, &hi, sizeof hi);
      }
      for (; i < half; i++) {
        const float a = xh[i], b = xh[half + i];
        xh[i] = a * ct[i] - b * st[i];
        xh[half + i] = b * ct[half + i] + a * st[half + i];
      }
    }
  }
}

void silu_and_mul(const float* gate_up, int64_t rows, int64_t inner, float* out, int num_threads) {
  #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
  for (int64_t r = 0; r < rows; r++) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    float* o = out + r * inner;
    int64_t c = 0;
    for (; c + 16 <= inner; c += 16) {
      const v16f gv = load16(g + c);
      const v16f y = gv / (exp16(-gv) + 1.0f) * load16(u + c);
      memcpy(o + c, &y, sizeof y);
    }
    for (; c < inner; c++) o[c] = g[c] / (expf(-g[c]) + 1.0f) * u[c];
  }
}
