/* batchlayers' hand-written optimizer kernels (see _native.py, which compiles this file on first use).
 *
 * One Adam/AdamW, SGD or RMSprop step over P float32 tensors stacked as (M, n_i), every model with its own
 * hyperparameters: one pass over each tensor, rounding as batchlayers.optim's compiled kernels (adam_kernel,
 * sgd_kernel, rmsprop_kernel: the foreach path's arithmetic, op for op; torch's CPU lerp, addcmul and add(alpha=) round once,
 * as fmaf does). Built with -ffp-contract=off, so no other product is fused into an add.
 *
 * Each value (a hyperparameter, or one derived from the step counts) is read from doubles, at
 * values[k][i * strides[2k] + m * strides[2k + 1]] for tensor i and model m (strides 0 for a value every tensor
 * or model shares). What is derived from them is computed in double as batchlayers.optim computes it in Python
 * floats or float64 tensors (1 - beta1, -lr / bc1, 1 - lr * weight_decay, -lr), then rounded to float as torch
 * rounds a float64 value for a float32 op.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include "../_native.h"

/* Adam's values: the hyperparameters, then the bias corrections 1 - beta1**t and (1 - beta2**t)**0.5 */
enum { LR, BETA1, BETA2, EPS, WEIGHT_DECAY, BIAS_CORRECTION1, BIAS_CORRECTION2_SQRT, ADAM_VALUES };
/* SGD's: lr, momentum, weight decay, and the momentum buffer's factors this step (buf = a * buf + b * grad) */
enum { SGD_LR, MOMENTUM, SGD_WEIGHT_DECAY, MOMENTUM_NOW, KEEP_NOW, SGD_VALUES };
/* RMSprop's: lr, alpha, eps, weight decay, momentum */
enum { RMS_LR, ALPHA, RMS_EPS, RMS_WEIGHT_DECAY, RMS_MOMENTUM, RMSPROP_VALUES };
enum { DECAY_NONE = 0, DECAY_L2 = 1, DECAY_DECOUPLED = 2 };
enum { NESTEROV = 1, NESTEROV_PLAIN_WITHOUT_MOMENTUM = 2 };

typedef struct job job;
struct job {
    int64_t P, M;
    /* P pointers each: the parameters, their gradients, then the states (Adam: exp_avg, exp_avg_sq and with
     * amsgrad max_exp_avg_sq; SGD: with momentum, momentum_buffer; RMSprop: square_avg, then grad_avg where
     * centered and momentum_buffer with momentum) */
    float *const *tensors;
    const int64_t *row_numel; /* n_i, the elements of one model's slice of tensor i */
    const double *const *values;
    const int64_t *strides;
    int maximize, decay, amsgrad, momentum, nesterov, centered, per_model_momentum;
    void (*span)(const job *, int64_t, int64_t, int64_t);
};

static inline double value(const job *job, int k, int64_t i, int64_t model) {
    return job->values[k][i * job->strides[2 * k] + model * job->strides[2 * k + 1]];
}

/* torch's CPU lerp(start, end, weight) is fmaf(coeff, end - start, base): coeff = weight and base = start where
 * |weight| < 0.5, else weight - 1 and end. */
typedef struct {
    float coeff;
    int from_start;
} lerp_form;

INLINE lerp_form lerp_of(float weight) {
    const int from_start = fabsf(weight) < 0.5f;
    const lerp_form form = {from_start ? weight : weight - 1.0f, from_start};
    return form;
}

/* The part of [begin, end) in model's slice of n elements: [first(...), last(...)) */
INLINE int64_t first(int64_t model, int64_t n, int64_t begin) { return model * n > begin ? model * n : begin; }
INLINE int64_t last(int64_t model, int64_t n, int64_t end) { return model * n + n < end ? model * n + n : end; }

/* The gradient as the step takes it: negated to maximize (sign -1), then the L2 decay added, as torch does. */
INLINE float gradient(float g, float p, float sign, const int l2, float decay) {
    g = g * sign;
    return l2 ? fmaf(p, decay, g) : g;
}

/* Each *_span computes elements [begin, end) of tensor i (counted over its models' slices in order) for one
 * combination of the job's flags: each a constant where it is inlined, so that every combination is a loop of
 * its own, without a branch, that the compiler vectorises. The gradient's sign (maximize) and the decoupled
 * decay are factors: -1 and 1 - lr * weight_decay, else exactly 1. */
INLINE void adam_span(const job *job, int64_t i, int64_t begin, int64_t end, const int l2, const int amsgrad) {
    const int64_t n = job->row_numel[i];
    float *restrict p = job->tensors[i];
    const float *restrict g_in = job->tensors[job->P + i];
    float *restrict m = job->tensors[2 * job->P + i];
    float *restrict v = job->tensors[3 * job->P + i];
    float *restrict v_max = amsgrad ? job->tensors[4 * job->P + i] : 0;
    for (int64_t model = begin / n; model * n < end; model++) {
        const double lr = value(job, LR, i, model), beta1 = value(job, BETA1, i, model);
        const double beta2 = value(job, BETA2, i, model), weight_decay = value(job, WEIGHT_DECAY, i, model);
        const float sign = job->maximize ? -1.0f : 1.0f, w1 = (float)(1.0 - beta1);
        const float b2 = (float)beta2, w2 = (float)(1.0 - beta2), eps = (float)value(job, EPS, i, model);
        const float neg_step_size = (float)(lr / -value(job, BIAS_CORRECTION1, i, model));
        const float bc2_sqrt = (float)value(job, BIAS_CORRECTION2_SQRT, i, model);
        const float l2_decay = (float)weight_decay;
        const float decoupled = job->decay == DECAY_DECOUPLED ? (float)(1.0 - lr * weight_decay) : 1.0f;
        const lerp_form average = lerp_of(w1);
        for (int64_t k = first(model, n, begin); k < last(model, n, end); k++) {
            const float g = gradient(g_in[k], p[k], sign, l2, l2_decay);
            const float avg = fmaf(average.coeff, g - m[k], average.from_start ? m[k] : g);
            float avg_sq = fmaf(g * w2, g, v[k] * b2);
            m[k] = avg;
            v[k] = avg_sq;
            if (amsgrad) {
                /* torch.maximum: NaN if either is */
                const float old = v_max[k];
                avg_sq = (old > avg_sq || old != old) ? old : avg_sq;
                v_max[k] = avg_sq;
            }
            const float denom = sqrtf(avg_sq) / bc2_sqrt + eps;
            p[k] = p[k] * decoupled + (avg * neg_step_size) / denom;
        }
    }
}

CLONES static void adam_tensor_span(const job *job, int64_t i, int64_t begin, int64_t end) {
    switch ((job->decay == DECAY_L2) * 2 + job->amsgrad) {
    case 0: adam_span(job, i, begin, end, 0, 0); break;
    case 1: adam_span(job, i, begin, end, 0, 1); break;
    case 2: adam_span(job, i, begin, end, 1, 0); break;
    default: adam_span(job, i, begin, end, 1, 1); break;
    }
}

/* SGD. A model with momentum 0 has a zeroed buffer and factors (0, 1) this step (batchlayers.optim.sgd puts
 * its buffer back afterwards); where the job says some model has (NESTEROV_PLAIN_WITHOUT_MOMENTUM), a Nesterov
 * step takes such a model's plain gradient, as torch does. */
INLINE void sgd_span(const job *job, int64_t i, int64_t begin, int64_t end, const int l2, const int momentum,
                     const int nesterov) {
    const int64_t n = job->row_numel[i];
    float *restrict p = job->tensors[i];
    const float *restrict g_in = job->tensors[job->P + i];
    float *restrict buf = momentum ? job->tensors[2 * job->P + i] : 0;
    for (int64_t model = begin / n; model * n < end; model++) {
        const float sign = job->maximize ? -1.0f : 1.0f, neg_lr = (float)-value(job, SGD_LR, i, model);
        const float weight_decay = (float)value(job, SGD_WEIGHT_DECAY, i, model);
        const float mu = (float)value(job, MOMENTUM, i, model);
        const float mu_now = (float)value(job, MOMENTUM_NOW, i, model), keep = (float)value(job, KEEP_NOW, i, model);
        const int plain = nesterov && job->nesterov == NESTEROV_PLAIN_WITHOUT_MOMENTUM && mu == 0.0f;
        for (int64_t k = first(model, n, begin); k < last(model, n, end); k++) {
            float g = gradient(g_in[k], p[k], sign, l2, weight_decay);
            if (momentum) {
                const float b = fmaf(g, keep, buf[k] * mu_now);
                buf[k] = b;
                if (nesterov) {
                    g = plain ? g : fmaf(b, mu, g); /* (plain: grad + 0 * inf would be NaN) */
                } else {
                    g = b;
                }
            }
            p[k] = fmaf(g, neg_lr, p[k]);
        }
    }
}

CLONES static void sgd_tensor_span(const job *job, int64_t i, int64_t begin, int64_t end) {
    const int l2 = job->decay == DECAY_L2;
    switch (l2 * 4 + job->momentum * 2 + (job->momentum && job->nesterov)) {
    case 0: sgd_span(job, i, begin, end, 0, 0, 0); break;
    case 2: sgd_span(job, i, begin, end, 0, 1, 0); break;
    case 3: sgd_span(job, i, begin, end, 0, 1, 1); break;
    case 4: sgd_span(job, i, begin, end, 1, 0, 0); break;
    case 6: sgd_span(job, i, begin, end, 1, 1, 0); break;
    default: sgd_span(job, i, begin, end, 1, 1, 1); break;
    }
}

/* RMSprop. With a per-model momentum, a model whose momentum is 0 takes the plain step (its buffer, updated
 * here, is put back by batchlayers.optim.rmsprop), as torch does. */
INLINE void rmsprop_span(const job *job, int64_t i, int64_t begin, int64_t end, const int l2, const int centered,
                         const int momentum) {
    const int64_t n = job->row_numel[i], P = job->P;
    float *restrict p = job->tensors[i];
    const float *restrict g_in = job->tensors[P + i];
    float *restrict sq = job->tensors[2 * P + i];
    float *restrict ga = centered ? job->tensors[3 * P + i] : 0;
    float *restrict buf = momentum ? job->tensors[(3 + centered) * P + i] : 0;
    for (int64_t model = begin / n; model * n < end; model++) {
        const double alpha = value(job, ALPHA, i, model);
        const float sign = job->maximize ? -1.0f : 1.0f, neg_lr = (float)-value(job, RMS_LR, i, model);
        const float a = (float)alpha, w = (float)(1.0 - alpha), eps = (float)value(job, RMS_EPS, i, model);
        const float weight_decay = (float)value(job, RMS_WEIGHT_DECAY, i, model);
        const float mu = (float)value(job, RMS_MOMENTUM, i, model);
        const int plain = job->per_model_momentum && !(mu > 0.0f);
        const lerp_form average = lerp_of(w);
        for (int64_t k = first(model, n, begin); k < last(model, n, end); k++) {
            const float g = gradient(g_in[k], p[k], sign, l2, weight_decay);
            const float s = fmaf(g * w, g, sq[k] * a);
            sq[k] = s;
            float avg;
            if (centered) {
                const float c = fmaf(average.coeff, g - ga[k], average.from_start ? ga[k] : g);
                ga[k] = c;
                avg = sqrtf(fmaf(-c, c, s));
            } else {
                avg = sqrtf(s);
            }
            avg = avg + eps;
            const float plain_step = p[k] + (g * neg_lr) / avg;
            if (momentum) {
                const float b = buf[k] * mu + g / avg;
                buf[k] = b;
                p[k] = plain ? plain_step : fmaf(b, neg_lr, p[k]);
            } else {
                p[k] = plain_step;
            }
        }
    }
}

CLONES static void rmsprop_tensor_span(const job *job, int64_t i, int64_t begin, int64_t end) {
    switch ((job->decay == DECAY_L2) * 4 + job->centered * 2 + job->momentum) {
    case 0: rmsprop_span(job, i, begin, end, 0, 0, 0); break;
    case 1: rmsprop_span(job, i, begin, end, 0, 0, 1); break;
    case 2: rmsprop_span(job, i, begin, end, 0, 1, 0); break;
    case 3: rmsprop_span(job, i, begin, end, 0, 1, 1); break;
    case 4: rmsprop_span(job, i, begin, end, 1, 0, 0); break;
    case 5: rmsprop_span(job, i, begin, end, 1, 0, 1); break;
    case 6: rmsprop_span(job, i, begin, end, 1, 1, 0); break;
    default: rmsprop_span(job, i, begin, end, 1, 1, 1); break;
    }
}

/* The job's elements [begin, end), counted over the tensors in order. */
static void run_range(const job *job, int64_t begin, int64_t end) {
    int64_t offset = 0;
    for (int64_t i = 0; i < job->P && offset < end; i++) {
        const int64_t size = job->row_numel[i] * job->M;
        const int64_t lo = begin > offset ? begin - offset : 0, hi = end - offset < size ? end - offset : size;
        if (lo < hi) {
            job->span(job, i, lo, hi);
        }
        offset += size;
    }
}

typedef struct {
    const job *job;
    int64_t begin, end;
} part;

static void *run_part(void *arg) {
    const part *own = (const part *)arg;
    run_range(own->job, own->begin, own->end);
    return 0;
}

#define MAX_THREADS 64

/* threads: how many threads share the elements (the calling one among them); a part whose thread cannot be
 * started runs in the calling thread. */
static void run(const job *job, int threads) {
    int64_t total = 0;
    for (int64_t i = 0; i < job->P; i++) {
        total += job->row_numel[i] * job->M;
    }
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    if (threads <= 1 || total < threads) {
        run_range(job, 0, total);
        return;
    }
    pthread_t handles[MAX_THREADS];
    part parts[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        parts[t].job = job;
        parts[t].begin = total * t / threads;
        parts[t].end = total * (t + 1) / threads;
    }
    int started = 1;
    for (; started < threads; started++) {
        if (pthread_create(&handles[started], 0, run_part, &parts[started]) != 0) {
            break;
        }
    }
    run_range(job, parts[0].begin, parts[0].end);
    for (int t = 1; t < started; t++) {
        pthread_join(handles[t], 0);
    }
    for (int t = started; t < threads; t++) {
        run_range(job, parts[t].begin, parts[t].end);
    }
}

/* counts: the step counts of every parameter's models (the tensor whose rows they are), each counting this step,
 * or NULL where the caller counts it: one add here instead of a torch op in the step. */
static void count_step(float *counts, int64_t numel) {
    for (int64_t i = 0; i < numel; i++) {
        counts[i] += 1.0f;
    }
}

void batchlayers_adam_f32(int64_t P, int64_t M, float *const *tensors, const int64_t *row_numel,
                          const double *const *values, const int64_t *strides, int maximize, int decay, int amsgrad,
                          float *counts, int64_t counts_numel, int threads) {
    const job job = {P, M, tensors, row_numel, values, strides, maximize, decay, amsgrad, 0, 0, 0, 0, adam_tensor_span};
    count_step(counts, counts_numel);
    run(&job, threads);
}

void batchlayers_sgd_f32(int64_t P, int64_t M, float *const *tensors, const int64_t *row_numel,
                         const double *const *values, const int64_t *strides, int maximize, int decay, int momentum,
                         int nesterov, float *counts, int64_t counts_numel, int threads) {
    const job job = {P, M, tensors, row_numel, values, strides, maximize, decay, 0, momentum, nesterov, 0, 0,
                     sgd_tensor_span};
    count_step(counts, counts_numel);
    run(&job, threads);
}

void batchlayers_rmsprop_f32(int64_t P, int64_t M, float *const *tensors, const int64_t *row_numel,
                             const double *const *values, const int64_t *strides, int maximize, int decay,
                             int centered, int momentum, int per_model_momentum, float *counts, int64_t counts_numel,
                             int threads) {
    const job job = {P,        M,        tensors,  row_numel, values, strides, maximize, decay,
                     0,        momentum, 0,        centered,  per_model_momentum, rmsprop_tensor_span};
    count_step(counts, counts_numel);
    run(&job, threads);
}
