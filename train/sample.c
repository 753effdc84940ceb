/*
 * sample.c - text generation from a weights file (see sample.h).
 *
 * Deliberately simple: every new byte reruns the full forward over the window (B = 1, T = seq_len),
 * with no KV cache. Positions after the context are filled with token 0; attention is causal, so they
 * cannot change the probabilities read at the last context position.
 */
#include "train/sample.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/rng.h"
#include "train/config.h"
#include "train/model.h"
#include "train/weights_io.h"

#define SAMPLE_RNG_PURPOSE 0x53414d50ULL  // "SAMP": keeps this stream apart from init and data streams

int sample_pick(const real *probs, int V, double temperature, double u) {
    if (temperature <= 0) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (probs[i] > probs[best]) best = i;
        return best;
    }
    // p_i^(1/temperature) = exp(log p_i / temperature), shifted by the max for range; done in double
    // in index order so the draw is reproducible.
    double max_logit = -INFINITY;
    for (int i = 0; i < V; i++) {
        double l = probs[i] > 0 ? log((double)probs[i]) / temperature : -INFINITY;
        if (l > max_logit) max_logit = l;
    }
    double total = 0;
    for (int i = 0; i < V; i++) total += probs[i] > 0 ? exp(log((double)probs[i]) / temperature - max_logit) : 0;
    double target = u * total, cum = 0;
    int last_nonzero = 0;
    for (int i = 0; i < V; i++) {
        if (probs[i] <= 0) continue;
        cum += exp(log((double)probs[i]) / temperature - max_logit);
        last_nonzero = i;
        if (target < cum) return i;
    }
    return last_nonzero;  // u * total rounded up past the final partial sum
}

int sample_run(const SampleOptions *opt, FILE *out, char *err, size_t err_size) {
    size_t prompt_len = opt->prompt ? strlen(opt->prompt) : 0;
    if (prompt_len == 0) {
        snprintf(err, err_size, "--prompt: the prompt is empty; give at least one character");
        return -1;
    }
    if (opt->steps < 0) {
        snprintf(err, err_size, "--steps: got %d, expected a number >= 0", opt->steps);
        return -1;
    }
    if (!(opt->temperature >= 0) || !isfinite(opt->temperature)) {
        snprintf(err, err_size, "--temperature: got %g, expected a finite number >= 0", opt->temperature);
        return -1;
    }
    Config cfg;
    if (weights_read_config(opt->weights_path, &cfg, err, err_size) != 0) return -1;
    if (cfg.model.vocab_size != 256) {
        snprintf(err, err_size,
                 "%s: model.vocab_size is %d; sampling needs a byte-level model (vocab_size = 256) because the "
                 "prompt is encoded as raw bytes", opt->weights_path, cfg.model.vocab_size);
        return -1;
    }
    // the run's thread setting (train.threads) applies here too: 0 = OpenMP's default
    if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
    Model m;
    char merr[1024];
    if (model_create(&m, &cfg, DEVICE_CPU, 1, merr, sizeof merr) != 0) {
        snprintf(err, err_size, "%s: cannot build the model from its stored config: %s", opt->weights_path, merr);
        return -1;
    }
    int rc = -1;
    ChunkActs *acts = NULL;
    int T = cfg.train.seq_len;
    size_t total = prompt_len + (size_t)opt->steps;
    int *text = malloc(total * sizeof *text);
    int *inputs = malloc((size_t)T * sizeof *inputs), *targets = malloc((size_t)T * sizeof *targets);
    if (!text || !inputs || !targets) {
        snprintf(err, err_size, "out of memory for %zu tokens", total);
        goto done;
    }
    if (weights_load(&m, opt->weights_path, err, err_size) != 0) goto done;
    m.count_load = 0;  // generation must not touch the balancer's load counts
    acts = chunk_acts_create(&m, 0, 1, T);
    if (!acts) {
        snprintf(err, err_size, "out of memory for the activations of 1 x %d tokens", T);
        goto done;
    }
    for (size_t i = 0; i < prompt_len; i++) text[i] = (unsigned char)opt->prompt[i];
    fwrite(opt->prompt, 1, prompt_len, out);
    fflush(out);
    uint64_t key = rng_key(opt->seed, 0, 0, SAMPLE_RNG_PURPOSE);
    size_t n = prompt_len;
    for (int s = 0; s < opt->steps; s++, n++) {
        // window: the last min(n, T) tokens; positions after it get token 0 and no target
        size_t start = n > (size_t)T ? n - (size_t)T : 0;
        int ctx = (int)(n - start);
        for (int t = 0; t < T; t++) inputs[t] = t < ctx ? text[start + (size_t)t] : 0;
        for (int t = 0; t < T; t++) targets[t] = t + 1 < ctx ? inputs[t + 1] : -1;
        chunk_forward(&m, 0, acts, inputs, targets, NULL, NULL);
        const real *probs = chunk_probs_at(acts, 0, ctx - 1);
        int next = sample_pick(probs, cfg.model.vocab_size, opt->temperature, rng_uniform(key, (uint64_t)s));
        text[n] = next;
        fputc(next, out);
        fflush(out);
    }
    fputc('\n', out);
    rc = 0;
done:
    if (acts) chunk_acts_free(acts);
    free(targets);
    free(inputs);
    free(text);
    model_free(&m);
    return rc;
}
