/* batchlayers' hand-written kernels for one time step of the LSTM and GRU recurrences' backward (see
 * _recurrent.py, _LSTMSteps.backward and _GRUSteps.backward; batchlayers/_native.py compiles this file with the
 * optimizer kernels on first use).
 *
 * The elementwise part of a step, for every model, sample and hidden unit in one pass, where torch's ops make
 * about ten passes (and calls): for an LSTM the gradient by o * tanh(c), by c, and by the four gates'
 * pre-activations. The arithmetic is the ops', op for op and in their order (torch's CPU sigmoid_backward is
 * a * (1 - b) * b, its tanh_backward a * (1 - b * b), whose 1 - b * b its AVX2 and AVX-512 kernels round once,
 * as fma does here), built with -ffp-contract=off so that no other product is fused into an add.
 *
 * The LSTM's operands are (N, B, K) with each model's (B, K) slice contiguous (K = H, or 4H for the gates, in
 * i, f, g, o order) and a model stride of their own, in elements.
 */
#include <math.h>
#include <stdint.h>

#include "../_native.h"

/* One sample's row of H units. grad_h_t: the gradient by h_t from the output; grad_h: from the next step (with
 * second 0, grad_h_t is their sum already, as with a projection). acts: the sigmoid of every gate's
 * pre-activation (the g slot unused), g: tanh of g's, c_prev: c_{t-1}, tanh_c: tanh(c_t). grad_c holds the
 * gradient by c_t and is overwritten by the one by c_{t-1}; d receives the gradient by the four
 * pre-activations. second is a constant where it is inlined: each case a loop without a branch, vectorised. */
#define LSTM_BACKWARD_ROW(T, SUFFIX, FMA)                                                                     \
    INLINE void lstm_backward_row_##SUFFIX(int64_t hidden, const T *restrict grad_h_t, const T *restrict grad_h, \
                                           const int second, const T *restrict acts, const T *restrict g,       \
                                           const T *restrict c_prev, const T *restrict tanh_c,                  \
                                           T *restrict grad_c, T *restrict d) {                                 \
        for (int64_t j = 0; j < hidden; j++) {                                                                  \
            const T grad_r = second ? grad_h_t[j] + grad_h[j] : grad_h_t[j]; /* by o * tanh(c) */               \
            const T i = acts[j], f = acts[hidden + j], o = acts[3 * hidden + j], t = tanh_c[j], gj = g[j];      \
            const T by_o = grad_r * t;                                                                          \
            const T by_c = grad_c[j] + (grad_r * o) * FMA(-t, t, (T)1);                                         \
            const T by_i = by_c * gj, by_f = by_c * c_prev[j];                                                  \
            d[j] = by_i * ((T)1 - i) * i;                                                                       \
            d[hidden + j] = by_f * ((T)1 - f) * f;                                                              \
            d[2 * hidden + j] = (by_c * i) * FMA(-gj, gj, (T)1);                                                \
            d[3 * hidden + j] = by_o * ((T)1 - o) * o;                                                          \
            grad_c[j] = by_c * f;                                                                               \
        }                                                                                                       \
    }

/* Every model's and sample's row; grad_h NULL where grad_h_t is the sum already. */
#define LSTM_BACKWARD_STEP(T, SUFFIX)                                                                           \
    CLONES void batchlayers_lstm_backward_step_##SUFFIX(                                                        \
        int64_t models, int64_t batch, int64_t hidden, const T *grad_h_t, int64_t grad_h_t_stride,             \
        const T *grad_h, int64_t grad_h_stride, const T *acts, int64_t acts_stride, const T *g, int64_t g_stride, \
        const T *c_prev, int64_t c_prev_stride, const T *tanh_c, int64_t tanh_c_stride, T *grad_c,             \
        int64_t grad_c_stride, T *d, int64_t d_stride) {                                                        \
        for (int64_t m = 0; m < models; m++) {                                                                  \
            for (int64_t b = 0; b < batch; b++) {                                                               \
                const int64_t row = b * hidden, gates_row = 4 * row;                                            \
                const T *gh_t = grad_h_t + m * grad_h_t_stride + row, *a = acts + m * acts_stride + gates_row;  \
                const T *gg = g + m * g_stride + row, *cp = c_prev + m * c_prev_stride + row;                   \
                const T *tc = tanh_c + m * tanh_c_stride + row;                                                 \
                T *gc = grad_c + m * grad_c_stride + row, *dd = d + m * d_stride + gates_row;                   \
                if (grad_h)                                                                                     \
                    lstm_backward_row_##SUFFIX(hidden, gh_t, grad_h + m * grad_h_stride + row, 1, a, gg, cp, tc, gc, dd); \
                else                                                                                            \
                    lstm_backward_row_##SUFFIX(hidden, gh_t, gh_t, 0, a, gg, cp, tc, gc, dd);                   \
            }                                                                                                   \
        }                                                                                                       \
    }

LSTM_BACKWARD_ROW(float, f32, fmaf)
LSTM_BACKWARD_ROW(double, f64, fma)
LSTM_BACKWARD_STEP(float, f32)
LSTM_BACKWARD_STEP(double, f64)

/* One GRU backward step, for _GRUSteps.backward. Operands are (N, B, K) with a model stride and a row (sample)
 * stride of their own, units contiguous: grad_h_t and grad_h as above (grad_h never NULL here), rz: the
 * activated r and z (z at +H), new: n, gh_n: h_{t-1} W_hn^T + b_hn, h_prev: h_{t-1}. Written: grad_in, the
 * gradient by the projected input's r, z and n (at +0, +H, +2H); grad_rec, by h_{t-1} W_hh^T + b_hh's (r and z
 * as grad_in's, then r times n's); grad_direct, z times the gradient by h_t (the part of the gradient by
 * h_{t-1} that skips the matrix product, which then accumulates onto it). torch's ops, op for op. */
#define GRU_BACKWARD_STEP(T, SUFFIX, FMA)                                                                      \
    INLINE void gru_backward_row_##SUFFIX(int64_t hidden, const T *restrict grad_h_t, const T *restrict grad_h, \
                                          const T *restrict rz, const T *restrict new, const T *restrict gh_n,  \
                                          const T *restrict h_prev, T *restrict grad_in, T *restrict grad_rec,  \
                                          T *restrict grad_direct) {                                            \
        for (int64_t j = 0; j < hidden; j++) {                                                                  \
            const T r = rz[j], z = rz[hidden + j], nj = new[j];                                                 \
            const T grad = grad_h_t[j] + grad_h[j];                                                             \
            const T direct = grad * z;                                                                          \
            const T grad_new = (grad - direct) * FMA(-nj, nj, (T)1);                                            \
            const T by_r = grad_new * gh_n[j], by_z = grad * (h_prev[j] - nj);                                  \
            const T in_r = by_r * ((T)1 - r) * r, in_z = by_z * ((T)1 - z) * z;                                 \
            grad_in[j] = in_r;                                                                                  \
            grad_in[hidden + j] = in_z;                                                                         \
            grad_in[2 * hidden + j] = grad_new;                                                                 \
            grad_rec[j] = in_r;                                                                                 \
            grad_rec[hidden + j] = in_z;                                                                        \
            grad_rec[2 * hidden + j] = grad_new * r;                                                            \
            grad_direct[j] = direct;                                                                            \
        }                                                                                                       \
    }                                                                                                           \
    CLONES void batchlayers_gru_backward_step_##SUFFIX(int64_t models, int64_t batch, int64_t hidden,          \
                                                       const T *const *inputs, T *const *outputs,              \
                                                       const int64_t *strides) {                               \
        /* inputs: grad_h_t, grad_h, rz, new, gh_n, h_prev; outputs: grad_in, grad_rec, grad_direct; strides: \
         * each operand's (model, row) strides in that order */                                                \
        for (int64_t m = 0; m < models; m++) {                                                                  \
            for (int64_t b = 0; b < batch; b++) {                                                               \
                const T *in[6];                                                                                 \
                T *out[3];                                                                                      \
                for (int k = 0; k < 6; k++) in[k] = inputs[k] + m * strides[2 * k] + b * strides[2 * k + 1];   \
                for (int k = 0; k < 3; k++)                                                                     \
                    out[k] = outputs[k] + m * strides[12 + 2 * k] + b * strides[13 + 2 * k];                    \
                gru_backward_row_##SUFFIX(hidden, in[0], in[1], in[2], in[3], in[4], in[5], out[0], out[1],      \
                                          out[2]);                                                              \
            }                                                                                                   \
        }                                                                                                       \
    }

GRU_BACKWARD_STEP(float, f32, fmaf)
GRU_BACKWARD_STEP(double, f64, fma)
