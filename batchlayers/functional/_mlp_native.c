/* batchlayers' hand-written chain of small linear layers with ReLU between them (see _mlp.py, _native_kernels;
 * batchlayers/_native.py compiles this file with the other kernels on first use).
 *
 * For M models, B samples and layers of d_0 -> d_1 -> ... -> d_L features, one call computes the whole forward
 * (y = W_L relu(... relu(W_1 x + b_1) ...) + b_L) and one the whole backward (every weight's and bias's gradient,
 * the input's where asked), model by model, where torch's ops take a batched GEMM, a bias add and an activation a
 * layer, each a call of a few microseconds, and autograd a node each. Inside a model every tensor is held
 * feature-major, (d, B): a layer's product is then vectorised over the samples (`product`: rows of B, a block of
 * 4 vectors of samples accumulated in registers over the layer's inputs) and a weight gradient is a dot product
 * over the samples (`weight_gradient`: four at once, their lanes summed together). The input is transposed once
 * in the forward (kept for the backward), the output gradient once in the backward.
 *
 * Results equal torch's up to the summation order of each product (float64 within 1e-13 of torch's ops, tested).
 * No product is fused into an add (-ffp-contract=off): every clone of a function rounds the same way.
 */
#include <stdint.h>
#include <string.h>

#include "../_native.h"

typedef float vector_f32 __attribute__((vector_size(32), aligned(4)));
typedef double vector_f64 __attribute__((vector_size(32), aligned(8)));
typedef int32_t mask_f32 __attribute__((vector_size(32))); /* a comparison's lanes: -1 true, 0 false */
typedef int64_t mask_f64 __attribute__((vector_size(32)));
typedef float half_f32 __attribute__((vector_size(16), aligned(4)));

/* (32-byte vectors passed between inlined functions only: GCC's note on their ABI does not apply) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* A vector of lanes chosen from a's and b's (b's numbered after a's). */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE(a, b, INDEX, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, INDEX, ...) __builtin_shuffle(a, b, (INDEX){__VA_ARGS__})
#endif

/* The four sums of s0, s1, s2 and s3's lanes into out[0..3]: pairs added across vectors (shuffles), not lane by
 * lane (summed lane by lane, the backward of a 10-20-2 MLP at M=64 took 126 us against 107). */
INLINE void sum_lanes4_f32(vector_f32 s0, vector_f32 s1, vector_f32 s2, vector_f32 s3, float *out) {
    typedef int32_t index __attribute__((vector_size(32), unused));
    const vector_f32 a = SHUFFLE(s0, s1, index, 0, 8, 2, 10, 4, 12, 6, 14) +
                         SHUFFLE(s0, s1, index, 1, 9, 3, 11, 5, 13, 7, 15);
    const vector_f32 b = SHUFFLE(s2, s3, index, 0, 8, 2, 10, 4, 12, 6, 14) +
                         SHUFFLE(s2, s3, index, 1, 9, 3, 11, 5, 13, 7, 15);
    const vector_f32 c = SHUFFLE(a, b, index, 0, 1, 8, 9, 4, 5, 12, 13) +
                         SHUFFLE(a, b, index, 2, 3, 10, 11, 6, 7, 14, 15);
    half_f32 low, high;
    memcpy(&low, &c, sizeof low);
    memcpy(&high, (const char *)&c + sizeof low, sizeof high);
    low += high;
    memcpy(out, &low, sizeof low);
}

INLINE void sum_lanes4_f64(vector_f64 s0, vector_f64 s1, vector_f64 s2, vector_f64 s3, double *out) {
    typedef int64_t index __attribute__((vector_size(32), unused));
    const vector_f64 a = SHUFFLE(s0, s1, index, 0, 4, 2, 6) + SHUFFLE(s0, s1, index, 1, 5, 3, 7);
    const vector_f64 b = SHUFFLE(s2, s3, index, 0, 4, 2, 6) + SHUFFLE(s2, s3, index, 1, 5, 3, 7);
    const vector_f64 c = SHUFFLE(a, b, index, 0, 1, 4, 5) + SHUFFLE(a, b, index, 2, 3, 6, 7);
    memcpy(out, &c, sizeof c);
}

typedef struct {
    int64_t models, batch, layers;
    const int64_t *dims;                   /* layers + 1 */
    const void *input;                     /* forward: x (M, B, d_0), rows contiguous; backward: the gradient by y */
    int64_t input_model_stride, input_row_stride;
    const void *const *weights;            /* (M, d_l+1, d_l), contiguous */
    const void *const *biases;             /* (M, d_l+1), contiguous, or NULL */
    void *const *hidden;                   /* (M, d_l+1, B) for l < L - 1: the ReLUs' outputs, feature-major */
    void *input_t;                         /* (M, d_0, B): x feature-major, written forward, read backward */
    void *output;                          /* forward: y (M, B, d_L); backward: the gradient by x or NULL */
    void *const *weight_grads, *const *bias_grads; /* backward: like weights and biases (a NULL bias's NULL) */
    void *work;                            /* forward: d_L * B elements; backward: (2 * the widest d_l + 1) * B */
} chain;

#define CHAIN_KERNELS(T, SUFFIX)                                                                                    \
    typedef vector_##SUFFIX V_##SUFFIX;                                                                             \
    enum { LANES_##SUFFIX = sizeof(V_##SUFFIX) / sizeof(T) };                                                       \
                                                                                                                    \
    INLINE V_##SUFFIX splat_##SUFFIX(T value) { return (V_##SUFFIX){0} + value; }                                   \
                                                                                                                    \
    /* s, ReLU'd (relu: 0 where below 0, NaN kept as torch's relu keeps it), or zeroed where mask is 0 or below     \
     * (threshold_backward: a NaN output passes the gradient), or as it is */                                       \
    INLINE V_##SUFFIX finish_##SUFFIX(V_##SUFFIX s, int relu, const T *mask) {                                      \
        if (relu) {                                                                                                 \
            return (V_##SUFFIX)((mask_##SUFFIX)s & ~(s < 0));                                                       \
        }                                                                                                           \
        return mask ? (V_##SUFFIX)((mask_##SUFFIX)s & ~(*(const V_##SUFFIX *)mask <= 0)) : s;                       \
    }                                                                                                               \
                                                                                                                    \
    /* out (n, B) = a (n, k) @ in (k, B) (+ bias), a's element (o, i) at a[o * row + i * column]; then ReLU (relu), \
     * or zero where mask (n, B) is not positive (ReLU's backward; mask NULL: neither). */                          \
    INLINE void product_##SUFFIX(int64_t batch, int64_t k, int64_t n, const T *restrict a, int64_t row,             \
                                 int64_t column, const T *restrict bias, const T *restrict in, int relu,            \
                                 const T *restrict mask, T *restrict out) {                                         \
        enum { LANES = LANES_##SUFFIX };                                                                            \
        for (int64_t o = 0; o < n; o++) {                                                                           \
            const T *restrict ao = a + o * row;                                                                     \
            const T start = bias ? bias[o] : (T)0;                                                                  \
            T *restrict out_o = out + o * batch;                                                                    \
            int64_t b = 0;                                                                                          \
            for (; b + 4 * LANES <= batch; b += 4 * LANES) {                                                        \
                V_##SUFFIX s0 = splat_##SUFFIX(start), s1 = s0, s2 = s0, s3 = s0;                                   \
                for (int64_t i = 0; i < k; i++) {                                                                   \
                    const V_##SUFFIX w = splat_##SUFFIX(ao[i * column]);                                            \
                    const V_##SUFFIX *restrict x = (const V_##SUFFIX *)(in + i * batch + b);                        \
                    s0 += w * x[0];                                                                                 \
                    s1 += w * x[1];                                                                                 \
                    s2 += w * x[2];                                                                                 \
                    s3 += w * x[3];                                                                                 \
                }                                                                                                   \
                const T *m = mask ? mask + o * batch + b : 0;                                                       \
                V_##SUFFIX *restrict y = (V_##SUFFIX *)(out_o + b);                                                 \
                y[0] = finish_##SUFFIX(s0, relu, m);                                                                \
                y[1] = finish_##SUFFIX(s1, relu, m ? m + LANES : 0);                                                \
                y[2] = finish_##SUFFIX(s2, relu, m ? m + 2 * LANES : 0);                                            \
                y[3] = finish_##SUFFIX(s3, relu, m ? m + 3 * LANES : 0);                                            \
            }                                                                                                       \
            for (; b + LANES <= batch; b += LANES) {                                                                \
                V_##SUFFIX s0 = splat_##SUFFIX(start);                                                              \
                for (int64_t i = 0; i < k; i++) {                                                                   \
                    s0 += splat_##SUFFIX(ao[i * column]) * *(const V_##SUFFIX *)(in + i * batch + b);               \
                }                                                                                                   \
                *(V_##SUFFIX *)(out_o + b) = finish_##SUFFIX(s0, relu, mask ? mask + o * batch + b : 0);            \
            }                                                                                                       \
            for (; b < batch; b++) {                                                                                \
                T s = start;                                                                                        \
                for (int64_t i = 0; i < k; i++) {                                                                   \
                    s += ao[i * column] * in[i * batch + b];                                                        \
                }                                                                                                   \
                out_o[b] = relu ? (s < 0 ? (T)0 : s) : mask ? (mask[o * batch + b] <= 0 ? (T)0 : s) : s;            \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
                                                                                                                    \
    /* grad_w (n, k) = g (n, B) @ in (k, B)^T and grad_b (n) the sums of g's rows (grad_b NULL: not computed),      \
     * as the dot products of g's rows with k + 1 rows: in's and ones (B of them), four rows at a time. */          \
    INLINE void weight_gradient_##SUFFIX(int64_t batch, int64_t k, int64_t n, const T *restrict g,                  \
                                         const T *restrict in, const T *restrict ones, T *restrict grad_w,          \
                                         T *restrict grad_b) {                                                      \
        enum { LANES = LANES_##SUFFIX };                                                                            \
        const int64_t full = batch - batch % LANES, rows = k + (grad_b != 0);                                       \
        for (int64_t o = 0; o < n; o++) {                                                                           \
            const T *restrict g_o = g + o * batch;                                                                  \
            for (int64_t i = 0; i < rows; i += 4) {                                                                 \
                const T *x[4]; /* (past the last row: the last row again, its sum not stored) */                    \
                for (int j = 0; j < 4; j++) {                                                                       \
                    const int64_t r = i + j < rows ? i + j : rows - 1;                                              \
                    x[j] = r < k ? in + r * batch : ones;                                                           \
                }                                                                                                   \
                V_##SUFFIX s0 = {0}, s1 = s0, s2 = s0, s3 = s0;                                                     \
                for (int64_t b = 0; b < full; b += LANES) {                                                         \
                    const V_##SUFFIX v = *(const V_##SUFFIX *)(g_o + b);                                            \
                    s0 += v * *(const V_##SUFFIX *)(x[0] + b);                                                      \
                    s1 += v * *(const V_##SUFFIX *)(x[1] + b);                                                      \
                    s2 += v * *(const V_##SUFFIX *)(x[2] + b);                                                      \
                    s3 += v * *(const V_##SUFFIX *)(x[3] + b);                                                      \
                }                                                                                                   \
                if (i + 4 <= k && full == batch) { /* four of grad_w's row: stored from the vector */               \
                    sum_lanes4_##SUFFIX(s0, s1, s2, s3, grad_w + o * k + i);                                        \
                    continue;                                                                                       \
                }                                                                                                   \
                T t[4];                                                                                             \
                sum_lanes4_##SUFFIX(s0, s1, s2, s3, t);                                                             \
                for (int j = 0; j < 4 && i + j < rows; j++) {                                                       \
                    for (int64_t b = full; b < batch; b++) {                                                        \
                        t[j] += g_o[b] * x[j][b];                                                                   \
                    }                                                                                               \
                    *(i + j < k ? grad_w + o * k + i + j : grad_b + o) = t[j];                                      \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
                                                                                                                    \
    /* dst (cols, rows), contiguous: src (rows, cols) transposed, its rows `stride` apart, its columns adjacent */  \
    INLINE void transpose_##SUFFIX(int64_t rows, int64_t cols, const T *restrict src, int64_t stride,               \
                                   T *restrict dst) {                                                               \
        for (int64_t j = 0; j < cols; j++) {                                                                        \
            for (int64_t i = 0; i < rows; i++) {                                                                    \
                dst[j * rows + i] = src[i * stride + j];                                                            \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
                                                                                                                    \
    CLONES void batchlayers_chain_forward_##SUFFIX(const chain *c) {                                                \
        const int64_t batch = c->batch, layers = c->layers, d0 = c->dims[0], dL = c->dims[layers];                  \
        T *restrict y_t = (T *)c->work; /* (d_L, B) */                                                              \
        for (int64_t m = 0; m < c->models; m++) {                                                                   \
            const T *x = (const T *)c->input + m * c->input_model_stride;                                           \
            T *x_t = (T *)c->input_t + m * d0 * batch;                                                              \
            transpose_##SUFFIX(batch, d0, x, c->input_row_stride, x_t);                                             \
            const T *in = x_t;                                                                                      \
            for (int64_t l = 0; l < layers; l++) {                                                                  \
                const int64_t k = c->dims[l], n = c->dims[l + 1];                                                   \
                const int last = l == layers - 1;                                                                   \
                T *out = last ? y_t : (T *)c->hidden[l] + m * n * batch;                                            \
                const T *bias = c->biases[l] ? (const T *)c->biases[l] + m * n : 0;                                 \
                product_##SUFFIX(batch, k, n, (const T *)c->weights[l] + m * n * k, k, 1, bias, in, !last, 0, out); \
                in = out;                                                                                           \
            }                                                                                                       \
            transpose_##SUFFIX(dL, batch, y_t, batch, (T *)c->output + m * batch * dL);                             \
        }                                                                                                           \
    }                                                                                                               \
                                                                                                                    \
    CLONES void batchlayers_chain_backward_##SUFFIX(const chain *c) {                                               \
        const int64_t batch = c->batch, layers = c->layers, d0 = c->dims[0], dL = c->dims[layers];                  \
        int64_t widest = 0;                                                                                         \
        for (int64_t l = 0; l <= layers; l++) {                                                                     \
            widest = c->dims[l] > widest ? c->dims[l] : widest;                                                     \
        }                                                                                                           \
        T *const first = (T *)c->work, *const second = first + widest * batch;                                      \
        T *const ones = second + widest * batch;                                                                    \
        for (int64_t b = 0; b < batch; b++) {                                                                       \
            ones[b] = 1;                                                                                            \
        }                                                                                                           \
        for (int64_t m = 0; m < c->models; m++) {                                                                   \
            const T *grad_y = (const T *)c->input + m * c->input_model_stride;                                      \
            T *g = first, *next = second; /* the gradient by layer l's output, (d_l+1, B); by its input */          \
            transpose_##SUFFIX(batch, dL, grad_y, c->input_row_stride, g);                                          \
            for (int64_t l = layers - 1; l >= 0; l--) {                                                             \
                const int64_t k = c->dims[l], n = c->dims[l + 1];                                                   \
                const T *in = (const T *)(l ? c->hidden[l - 1] : c->input_t) + m * k * batch;                       \
                const T *w = (const T *)c->weights[l] + m * n * k;                                                  \
                T *grad_b = c->bias_grads[l] ? (T *)c->bias_grads[l] + m * n : 0;                                   \
                weight_gradient_##SUFFIX(batch, k, n, g, in, ones, (T *)c->weight_grads[l] + m * n * k, grad_b);    \
                if (l) { /* by the ReLU's output, then by its input */                                              \
                    product_##SUFFIX(batch, n, k, w, 1, k, 0, g, 0, in, next);                                      \
                } else if (c->output) {                                                                             \
                    product_##SUFFIX(batch, n, k, w, 1, k, 0, g, 0, 0, next);                                       \
                    transpose_##SUFFIX(d0, batch, next, batch, (T *)c->output + m * batch * d0);                    \
                }                                                                                                   \
                T *swap = g;                                                                                        \
                g = next;                                                                                           \
                next = swap;                                                                                        \
            }                                                                                                       \
        }                                                                                                           \
    }

CHAIN_KERNELS(float, f32)
CHAIN_KERNELS(double, f64)
