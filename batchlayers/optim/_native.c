/* batchlayers' hand-written optimizer kernels (see _native.py, which compiles this file on first use).
 *
 * One Adam/AdamW or SGD step over P float32 tensors stacked as (M, n_i), every model with its own
 * hyperparameters: one pass over each tensor, rounding as batchlayers.optim's compiled kernels (adam_kernel,
 * sgd_kernel: the foreach path's arithmetic, op for op; torch's CPU lerp, addcmul and add(alpha=) round once,
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

/* Adam's values: the hyperparameters, then the bias corrections 1 - beta1**t and (1 - beta2**t)**0.5 */
enum { LR, BETA1, BETA2, EPS, WEIGHT_DECAY, BIAS_CORRECTION1, BIAS_CORRECTION2_SQRT, ADAM_VALUES };
/* SGD's: lr, momentum, weight decay, and the momentum buffer's factors this step (buf = a * buf + b * grad) */
enum { SGD_LR, MOMENTUM, SGD_WEIGHT_DECAY, MOMENTUM_NOW, KEEP_NOW, SGD_VALUES };
enum { DECAY_NONE = 0, DECAY_L2 = 1, DECAY_DECOUPLED = 2 };
enum { NESTEROV = 1, NESTEROV_PLAIN_WITHOUT_MOMENTUM = 2 };

typedef struct job job;
struct job {
    int64_t P, M;
    /* P pointers each: the parameters, their gradients, then the states (Adam: exp_avg, exp_avg_sq and with
     * amsgrad max_exp_avg_sq; SGD: with momentum, momentum_buffer) */
    float *const *tensors;
    const int64_t *row_numel; /* n_i, the elements of one model's slice of tensor i */
    const double *const *values;
    const int64_t *strides;
    int maximize, decay, amsgrad, momentum, nesterov;
    void (*span)(const job *, int64_t, int64_t, int64_t);
};

static inline double value(const job *job, int k, int64_t i, int64_t model) {
    return job->values[k][i * job->strides[2 * k] + model * job->strides[2 * k + 1]];
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

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
        /* torch's lerp: weight + its first formula where |weight| < 0.5, else its second */
        const int start_form = fabsf(w1) < 0.5f;
        const float coeff = start_form ? w1 : w1 - 1.0f;
        const int64_t lo = model * n > begin ? model * n : begin, hi = model * n + n < end ? model * n + n : end;
        for (int64_t k = lo; k < hi; k++) {
            float g = g_in[k] * sign;
            if (l2) {
                g = fmaf(p[k], l2_decay, g);
            }
            const float avg = fmaf(coeff, g - m[k], start_form ? m[k] : g);
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
        const int64_t lo = model * n > begin ? model * n : begin, hi = model * n + n < end ? model * n + n : end;
        for (int64_t k = lo; k < hi; k++) {
            float g = g_in[k] * sign;
            if (l2) {
                g = fmaf(p[k], weight_decay, g);
            }
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

void batchlayers_adam_f32(int64_t P, int64_t M, float *const *tensors, const int64_t *row_numel,
                          const double *const *values, const int64_t *strides, int maximize, int decay, int amsgrad,
                          int threads) {
    const job job = {P, M, tensors, row_numel, values, strides, maximize, decay, amsgrad, 0, 0, adam_tensor_span};
    run(&job, threads);
}

void batchlayers_sgd_f32(int64_t P, int64_t M, float *const *tensors, const int64_t *row_numel,
                         const double *const *values, const int64_t *strides, int maximize, int decay, int momentum,
                         int nesterov, int threads) {
    const job job = {P, M, tensors, row_numel, values, strides, maximize, decay, 0, momentum, nesterov,
                     sgd_tensor_span};
    run(&job, threads);
}
