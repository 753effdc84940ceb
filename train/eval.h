/*
 * eval.h - `fp8moe eval CKPT [--text FILE | --shards DIR] [--batches N] [--set section.key=value]...`: the main and
 * MTP losses of a trained model on given data, without training.
 *
 * The model comes from a checkpoint (any layout) or a weights file (train/model_source.h) and runs whole in one
 * process, on train.device, in fp32 mode unless --set precision.mode says otherwise. The data is evaluated as the
 * trainer evaluates (train/trainer.c): the loader's evaluation pass (data/loader.h: windows of seq_len + 1 tokens at
 * stride seq_len, every token but a shard's first a main target once, the last window padded), micro-batches of
 * train.micro_batch_size, rows with no target skipped, load counting off. So on the job's validation split with the
 * trainer's train.eval_batches, the same weights and thread count, eval prints the trainer's val_loss bit for bit.
 *
 * Data: --text FILE: every byte of FILE (byte-level models), as one shard; --shards DIR: the validation split of an
 * llm.c shard directory (its *_val_*.bin shards); neither: the job's own validation split (data.shards, or data.text
 * prepared into data.cache_dir as the trainer prepares it, which it does again when missing).
 */
#ifndef FP8MOE_EVAL_H
#define FP8MOE_EVAL_H

extern const char *const eval_usage;
// Exit status as train/main.c's: 0, 1 a failure while running, 2 bad usage or a bad --set.
int eval_main(int argc, char **argv);

#endif
