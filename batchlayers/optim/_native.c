/* batchlayers' hand-written optimizer kernels (see _native.py, which compiles this file on first use).
 *
 * One Adam/AdamW step over P float32 tensors stacked as (M, n_i), every model with its own hyperparameters:
 * one pass over each tensor, rounding as batchlayers.optim.adam.adam_kernel (the foreach path's arithmetic,
 * op for op; torch's CPU lerp, addcmul and add(alpha=) round once, as fmaf does). Built with
 * -ffp-contract=off, so no other product is fused into an add.
 *
 * Each of the ADAM_VALUES values (the hyperparameters and the bias corrections 1 - beta1**t and
 * (1 - beta2**t)**0.5) is read from doubles, at values[k][i * strides[2k] + m * strides[2k + 1]] for tensor i
 * and model m (strides 0 for a value every tensor or model shares). The values derived from them are computed
 * in double as batchlayers.optim computes them in Python floats or float64 tensors (1 - beta1, -lr / bc1,
 * 1 - lr * weight_decay), then rounded to float as torch rounds a float64 value for a float32 op.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

enum { LR, BETA1, BETA2, EPS, WEIGHT_DECAY, BIAS_CORRECTION1, BIAS_CORRECTION2_SQRT, ADAM_VALUES };
enum { DECAY_NONE = 0, DECAY_L2 = 1, DECAY_DECOUPLED = 2 };

typedef struct {
    int64_t P, M;
    /* P pointers each: the parameters, their gradients, exp_avg, exp_avg_sq and with amsgrad max_exp_avg_sq */
    float *const *tensors;
    const int64_t *row_numel; /* n_i, the elements of one model's slice of tensor i */
    const double *const *values;
    const int64_t *strides;
    int maximize, decay, amsgrad;
} adam_job;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Elements [begin, end) of tensor i (counted over its models' slices in order), for one combination of the
 * job's flags: each a constant where this is inlined, so that every combination is a loop of its own, without
 * a branch, that the compiler vectorises. The gradient's sign (maximize) and the decoupled decay are factors:
 * -1 and 1 - lr * weight_decay, else exactly 1. */
static inline __attribute__((always_inline)) void adam_span(const adam_job *job, int64_t i, int64_t begin,
                                                            int64_t end, const int l2, const int amsgrad) {
    const int64_t n = job->row_numel[i];
    float *restrict p = job->tensors[i];
    const float *restrict g_in = job->tensors[job->P + i];
    float *restrict m = job->tensors[2 * job->P + i];
    float *restrict v = job->tensors[3 * job->P + i];
    float *restrict v_max = amsgrad ? job->tensors[4 * job->P + i] : 0;
    for (int64_t model = begin / n; model * n < end; model++) {
        double val[ADAM_VALUES];
        for (int k = 0; k < ADAM_VALUES; k++) {
            val[k] = job->values[k][i * job->strides[2 * k] + model * job->strides[2 * k + 1]];
        }
        const float sign = job->maximize ? -1.0f : 1.0f;
        const float w1 = (float)(1.0 - val[BETA1]), beta2 = (float)val[BETA2], w2 = (float)(1.0 - val[BETA2]);
        const float eps = (float)val[EPS], bc2_sqrt = (float)val[BIAS_CORRECTION2_SQRT];
        const float neg_step_size = (float)(val[LR] / -val[BIAS_CORRECTION1]);
        const float l2_decay = (float)val[WEIGHT_DECAY];
        const float decoupled = job->decay == DECAY_DECOUPLED ? (float)(1.0 - val[LR] * val[WEIGHT_DECAY]) : 1.0f;
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
            float avg_sq = fmaf(g * w2, g, v[k] * beta2);
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

CLONES static void adam_tensor_span(const adam_job *job, int64_t i, int64_t begin, int64_t end) {
    const int l2 = job->decay == DECAY_L2;
    switch (l2 * 2 + job->amsgrad) {
    case 0: adam_span(job, i, begin, end, 0, 0); break;
    case 1: adam_span(job, i, begin, end, 0, 1); break;
    case 2: adam_span(job, i, begin, end, 1, 0); break;
    default: adam_span(job, i, begin, end, 1, 1); break;
    }
}

/* The job's elements [begin, end), counted over the tensors in order. */
static void adam_range(const adam_job *job, int64_t begin, int64_t end) {
    int64_t offset = 0;
    for (int64_t i = 0; i < job->P && offset < end; i++) {
        const int64_t size = job->row_numel[i] * job->M;
        const int64_t lo = begin > offset ? begin - offset : 0, hi = end - offset < size ? end - offset : size;
        if (lo < hi) {
            adam_tensor_span(job, i, lo, hi);
        }
        offset += size;
    }
}

typedef struct {
    const adam_job *job;
    int64_t begin, end;
} adam_part;

static void *adam_part_run(void *arg) {
    const adam_part *part = (const adam_part *)arg;
    adam_range(part->job, part->begin, part->end);
    return 0;
}

#define MAX_THREADS 64

/* threads: how many threads share the elements (the calling one among them); a part whose thread cannot be
 * started runs in the calling thread. */
void batchlayers_adam_f32(int64_t P, int64_t M, float *const *tensors, const int64_t *row_numel,
                         const double *const *values, const int64_t *strides, int maximize, int decay, int amsgrad,
                         int threads) {
    adam_job job = {P, M, tensors, row_numel, values, strides, maximize, decay, amsgrad};
    int64_t total = 0;
    for (int64_t i = 0; i < P; i++) {
        total += row_numel[i] * M;
    }
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    if (threads <= 1 || total < threads) {
        adam_range(&job, 0, total);
        return;
    }
    pthread_t handles[MAX_THREADS];
    adam_part parts[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        parts[t].job = &job;
        parts[t].begin = total * t / threads;
        parts[t].end = total * (t + 1) / threads;
    }
    int started = 1;
    for (; started < threads; started++) {
        if (pthread_create(&handles[started], 0, adam_part_run, &parts[started]) != 0) {
            break;
        }
    }
    adam_range(&job, parts[0].begin, parts[0].end);
    for (int t = 1; t < started; t++) {
        pthread_join(handles[t], 0);
    }
    /* Parts whose thread did not start: run here. */
    for (int t = started; t < threads; t++) {
        adam_range(&job, parts[t].begin, parts[t].end);
    }
}
