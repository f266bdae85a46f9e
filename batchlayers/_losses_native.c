/* batchlayers' hand-written two-class cross entropy (see losses.py, _native_two_class_terms and
 * _native_two_class_input_grad; batchlayers/_native.py compiles this file with the other kernels on first use).
 *
 * For logits (M, B, 2) whose (B, 2) rows are contiguous and class indices (M, B) that are all 0 or 1, the loss of
 * a row is softplus(z) with z = sign * (x_1 - x_0) and sign = +1 for class 0, -1 for class 1 (the other class's
 * logit minus the target's), and the gradient by x_1 - x_0 is sign * sigmoid(z): losses.py's formula, which
 * takes about twenty torch calls forward and backward (each a few microseconds) where this takes one each.
 *
 * Both come from e = exp(-|z|): softplus(z) = max(z, 0) + log1p(e), sigmoid(z) = 1 / (1 + e) for z >= 0 and
 * e / (1 + e) below. float64 calls libm's exp and log1p; float32 computes them with the polynomials below, which
 * vectorise (a libm call per element would not): losses within 3 ulp of the exact values, probabilities within 2
 * (measured over z in [-110, 110]: 2.6 and 1.7; tests/test_losses.py asserts 3 ulp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_native.h"

/* 2^k for -126 <= k <= 127 */
INLINE float power_of_two_f32(int32_t k) {
    const int32_t bits = (k + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp(x) for x <= 0 in float: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (the
 * remainder is below 6e-9 relative) and 2^n as two powers of two (each a normal float down to n = -152, so
 * that a result below FLT_MIN rounds once, to the subnormal float). Below -104 the result is 0, as expf's. */
INLINE float exp_nonpositive_f32(float x) {
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = x >= -104.0f ? x : -104.0f; /* (NaN too: no NaN reaches the conversion to int below) */
    const float t = x * 1.44269504f + shift;
    const float n = t - shift;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f; /* ln2 in two parts: n * 0.693359375 is exact */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t k = (int32_t)n, half = k >> 1;
    return p * power_of_two_f32(half) * power_of_two_f32(k - half);
}

/* log1p(e) for 0 <= e <= 1, given u = 1 + e rounded: u = 2^j (1 + f) with 1 + f in [sqrt(2)/2, sqrt(2)],
 * log(1 + f) = 2 atanh(s) with s = f / (2 + f) (|s| < 0.172) by its series to s^9 (remainder below 3e-9
 * relative), and the rounding of u corrected by (e - (u - 1)) / u. */
INLINE float log1p_unit_f32(float e, float u, float inverse_u) {
    const int high = u > 1.41421356f;
    const float m = high ? u * 0.5f : u;
    const float f = m - 1.0f; /* exact */
    const float s = f / (2.0f + f), s2 = s * s;
    float q = 1.0f / 9.0f;
    q = q * s2 + 1.0f / 7.0f;
    q = q * s2 + 1.0f / 5.0f;
    q = q * s2 + 1.0f / 3.0f;
    q = q * s2 + 1.0f;
    const float log_m = 2.0f * s * q;
    const float corrected = log_m + (e - (u - 1.0f)) * inverse_u;
    return high ? corrected + 0.693147182f : corrected;
}

INLINE double exp_nonpositive_f64(double x) { return exp(x); }
INLINE double log1p_unit_f64(double e, double u, double inverse_u) { return (void)u, (void)inverse_u, log1p(e); }

/* Forward: signed_probability (M, B), contiguous, and total (M,), each model's summed loss divided by divisor.
 * input: rows of 2 contiguous, model m at input + m * input_model_stride; target (int64) at
 * target + m * target_model_stride (0: one row of targets shared by every model). Returns 0; 1 where a target
 * is neither 0 nor 1, 2 where some z is infinite or NaN (losses.py then takes torch's ops; what was written
 * is not read). ACC: the sum's type (double for float32, as the error of a float sum grows with B). */
#define TWO_CLASS_FORWARD(T, ACC, SUFFIX)                                                                         \
    CLONES int batchlayers_two_class_forward_##SUFFIX(int64_t models, int64_t batch, const T *input,              \
                                                      int64_t input_model_stride, const int64_t *target,          \
                                                      int64_t target_model_stride, T divisor,                     \
                                                      T *restrict signed_probability, T *restrict total) {        \
        int64_t bad_target = 0;                                                                                   \
        T not_finite = 0; /* NaN once some z is infinite or NaN: inf * 0 and NaN * 0 are NaN */                   \
        for (int64_t m = 0; m < models; m++) {                                                                    \
            const T *restrict x = input + m * input_model_stride;                                                 \
            const int64_t *restrict t = target + m * target_model_stride;                                         \
            T *restrict sp = signed_probability + m * batch;                                                      \
            ACC sum = 0;                                                                                          \
            _Pragma("omp simd reduction(+ : sum, not_finite) reduction(| : bad_target)")                          \
            for (int64_t b = 0; b < batch; b++) {                                                                 \
                bad_target |= t[b] & ~(int64_t)1;                                                                 \
                const T sign = t[b] ? (T)-1 : (T)1;                                                               \
                const T z = (x[2 * b + 1] - x[2 * b]) * sign;                                                     \
                not_finite += z * (T)0;                                                                           \
                const T e = exp_nonpositive_##SUFFIX(z < 0 ? z : -z);                                             \
                const T u = (T)1 + e, inverse_u = (T)1 / u;                                                       \
                sum += (ACC)((z > 0 ? z : (T)0) + log1p_unit_##SUFFIX(e, u, inverse_u));                          \
                sp[b] = (z >= 0 ? inverse_u : e * inverse_u) * sign;                                              \
            }                                                                                                     \
            total[m] = (T)sum / divisor;                                                                          \
        }                                                                                                         \
        return bad_target ? 1 : not_finite != not_finite ? 2 : 0;                                                 \
    }

/* Backward: grad_input (M, B, 2), contiguous: by x_1 signed_probability * (grad[m] / divisor), by x_0 its
 * negative (losses.py's _two_class_input_grad, op for op); grad (M,) at grad + m * grad_stride. */
#define TWO_CLASS_BACKWARD(T, SUFFIX)                                                                             \
    CLONES void batchlayers_two_class_backward_##SUFFIX(int64_t models, int64_t batch,                            \
                                                        const T *restrict signed_probability, const T *grad,      \
                                                        int64_t grad_stride, T divisor, T *restrict grad_input) {  \
        for (int64_t m = 0; m < models; m++) {                                                                    \
            const T scale = grad[m * grad_stride] / divisor;                                                      \
            const T *restrict sp = signed_probability + m * batch;                                                \
            T *restrict out = grad_input + 2 * m * batch;                                                         \
            for (int64_t b = 0; b < batch; b++) {                                                                 \
                const T by_second = sp[b] * scale;                                                                \
                out[2 * b] = -by_second;                                                                          \
                out[2 * b + 1] = by_second;                                                                       \
            }                                                                                                     \
        }                                                                                                         \
    }

TWO_CLASS_FORWARD(float, double, f32)
TWO_CLASS_FORWARD(double, double, f64)
TWO_CLASS_BACKWARD(float, f32)
TWO_CLASS_BACKWARD(double, f64)
