/*
 * checkpoint.c - sharded, atomic HDF5 checkpoints of a TrainState and their resume under any layout (see
 * checkpoint.h for what is written and guaranteed, docs/checkpoints.md for the format).
 *
 * Order of the file: helpers (collective agreement, HDF5 attributes and datasets), the config comparison,
 * writing a rank file and the manifest, the directory steps of a save (partial ones removed, the atomic
 * rename, DIR/latest, pruning), checkpoint_save; then reading the manifest and checkpoint_load, which
 * walks every rank file once and takes from each the tensors, moment pieces and router biases this rank
 * holds, then checks that every element it needs was found.
 *
 * Why the moments are written per tensor and not as the flat region: the flat buffer's layout depends on
 * the placement (which experts a rank holds, alignment padding), and a ZeRO-1 shard boundary on the layout
 * (dp size); by global tensor name and a row-major element offset within the tensor, a piece means the same
 * under every layout, so a resume can cut the pieces again along its own shard boundaries. Padding between
 * tensors gets zero gradients, so its moments stay zero and are not written.
 *
 * HDF5 calls are made between h5io_quiet and h5io_restore; every return code is checked, and a failure is
 * reported with the file and the dataset (train/h5io.h for the save protocol on a full disk).
 *
 * One file of about 1400 lines rather than a save and a load file: the two share the format's private helpers
 * (dataset and attribute names, the BF16 type, the file table's compound type, the rank file names), and keeping
 * them in one place is what keeps the writer and the reader agreeing on every name.
 */
#include "train/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/durable.h"
#include "train/fault.h"
#include "train/h5io.h"

#define CK_ERR 2048                      // the message every rank agrees on
#define CK_PATH (CHECKPOINT_DIR_MAX + 128)  // DIR/step_NNNNNNNN/rankRRRRR-stageS-dpD-epE.h5
#define CK_CHUNK_BYTES (1 << 20)         // HDF5 chunk size aimed at (Fletcher32 works per chunk)
#define CK_FILE_NAME_MAX 64

// ---------------------------------------------------------------------------- helpers

// Where this process is in the job (one process without groups).
typedef struct {
    Comm *world;
    Layout layout;
    RankCoords me;
} Where;

static Where where_of(const Groups *g) {
    if (g) return (Where){.world = g->world, .layout = g->layout, .me = g->me};
    return (Where){.world = comm_world_single(), .layout = {1, 1, 1, 1, 1}, .me = {0}};
}

// Collective: 0 when no rank of world failed; otherwise -1 on every rank, err = the message of the lowest
// failing rank ("rank R: ..." in a job of several ranks).
static int agree(Comm *world, int failed, char *err, size_t err_size) {
    double first = failed ? (double)world->rank : (double)world->size;
    comm_allreduce_min_double(world, &first, 1);
    if (first >= world->size) return 0;
    const int root = (int)first;
    char msg[CK_ERR];
    if (world->rank == root) snprintf(msg, sizeof msg, "%s", err);
    comm_bcast_bytes(world, msg, sizeof msg, root);
    if (world->size > 1) snprintf(err, err_size, "rank %d: %s", root, msg);
    else snprintf(err, err_size, "%s", msg);
    return -1;
}

// Reads integer attribute `name` of obj: exactly n values (a scalar is one).
static int read_i64_attr(hid_t obj, const char *path, const char *what, const char *name, int64_t *v, int n,
                         char *err, size_t err_size) {
    htri_t exists = H5Aexists(obj, name);
    if (exists <= 0) {
        snprintf(err, err_size, "%s: %s: attribute %s %s", path, what, name,
                 exists < 0 && h5io_checksum_failed() ? "fails its checksum (the file is corrupted)"
                                                      : "is missing (expected a checkpoint written by fp8moe)");
        return -1;
    }
    hid_t attr = H5Aopen(obj, name, H5P_DEFAULT), space = -1, type = -1;
    int ok = attr >= 0 && (space = H5Aget_space(attr)) >= 0 && (type = H5Aget_type(attr)) >= 0 &&
             H5Tget_class(type) == H5T_INTEGER && H5Sget_simple_extent_npoints(space) == n &&
             H5Aread(attr, H5T_NATIVE_INT64, v) >= 0;
    h5io_close(type, H5Tclose);
    h5io_close(space, H5Sclose);
    h5io_close(attr, H5Aclose);
    if (!ok) snprintf(err, err_size, "%s: %s: attribute %s: expected %d integer%s", path, what, name, n, n == 1 ? "" : "s");
    return ok ? 0 : -1;
}

// BF16 as an HDF5 float type: sign bit 15, 8 exponent bits at 7 (bias 127), 7 mantissa bits, 2 bytes; the top
// half of an IEEE FP32. h5dump prints its values; reading it with this same type copies the bits unchanged.
static hid_t bf16_type(void) {
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    if (t < 0) return -1;
    if (H5Tset_fields(t, 15, 7, 8, 0, 7) < 0 || H5Tset_precision(t, 16) < 0 || H5Tset_size(t, 2) < 0 ||
        H5Tset_ebias(t, 127) < 0) {
        H5Tclose(t);
        return -1;
    }
    return t;
}

// Dataset creation properties: chunks of about CK_CHUNK_BYTES (the leading dimensions cut first) and the
// Fletcher32 checksum filter, which needs chunked storage.
static hid_t checked_dcpl(int ndim, const hsize_t *dims, size_t elem_bytes) {
    hsize_t chunk[H5S_MAX_RANK];
    for (int d = 0; d < ndim; d++) chunk[d] = dims[d] > 0 ? dims[d] : 1;
    for (int d = 0; d < ndim; d++) {
        size_t inner = elem_bytes;  // bytes of one index of dimension d
        for (int k = d + 1; k < ndim; k++) inner *= (size_t)chunk[k];
        if (inner * chunk[d] <= CK_CHUNK_BYTES) break;
        const hsize_t fit = CK_CHUNK_BYTES / inner;
        chunk[d] = fit > 0 ? fit : 1;
        if (fit > 0) break;
    }
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    if (dcpl < 0 || H5Pset_chunk(dcpl, ndim, chunk) < 0 || H5Pset_fletcher32(dcpl) < 0) {
        h5io_close(dcpl, H5Pclose);
        return -1;
    }
    return dcpl;
}

// Dataset `name` of shape dims from data, chunked with Fletcher32 (checked_dcpl), with integer attributes.
static int write_dataset(hid_t file, const char *path, const char *name, hid_t ftype, hid_t mtype, size_t elem_bytes,
                         int ndim, const hsize_t *dims, const void *data, const H5I64Attr *attrs, int n_attrs,
                         char *err, size_t err_size) {
    const hid_t dcpl = checked_dcpl(ndim, dims, elem_bytes);
    if (dcpl < 0) {
        snprintf(err, err_size, "%s: dataset /%s: cannot set up its chunked, checksummed layout", path, name);
        h5io_discard_writes(file);
        return -1;
    }
    const int rc = h5io_write_dataset(file, path, name, ftype, mtype, ndim, dims, dcpl, data, attrs, n_attrs, err,
                                      err_size);
    h5io_close(dcpl, H5Pclose);
    return rc;
}

static int make_group(hid_t file, const char *path, const char *name, char *err, size_t err_size) {
    char cause[160];
    hid_t grp = H5Gcreate2(file, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (grp < 0 || H5Gclose(grp) < 0) {
        snprintf(err, err_size, "%s: group /%s: cannot create it%s", path, name, h5io_cause(cause, sizeof cause, ""));
        h5io_discard_writes(file);
        return -1;
    }
    return 0;
}

// Opens dataset `name` and reads its shape (at most H5S_MAX_RANK dims), naming a checksum failure.
static hid_t open_dataset(hid_t file, const char *path, const char *name, int *ndim, hsize_t *dims, char *err,
                          size_t err_size) {
    hid_t dset = H5Dopen2(file, name, H5P_DEFAULT), space = -1;
    if (dset < 0) {
        snprintf(err, err_size, "%s: dataset /%s: cannot open it%s", path, name,
                 h5io_checksum_failed() ? ": its object header fails its checksum (the file is corrupted)" : "");
        return -1;
    }
    if ((space = H5Dget_space(dset)) < 0 || (*ndim = H5Sget_simple_extent_dims(space, dims, NULL)) < 0) {
        snprintf(err, err_size, "%s: dataset /%s: cannot read its shape", path, name);
        h5io_close(space, H5Sclose);
        H5Dclose(dset);
        return -1;
    }
    H5Sclose(space);
    return dset;
}

// Reads all of dset as mtype into buf; a Fletcher32 failure is named as such.
static int read_dataset(hid_t dset, hid_t mtype, void *buf, const char *path, const char *name, char *err,
                        size_t err_size) {
    if (H5Dread(dset, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0) return 0;
    char cause[160];
    if (h5io_checksum_failed())
        snprintf(err, err_size, "%s: dataset /%s: Fletcher32 checksum mismatch: the file is corrupted", path, name);
    else
        snprintf(err, err_size, "%s: dataset /%s: read failed%s", path, name, h5io_cause(cause, sizeof cause, ""));
    return -1;
}

static void format_shape(char *buf, size_t size, int ndim, const int64_t *shape) {
    size_t len = (size_t)snprintf(buf, size, "(");
    for (int d = 0; d < ndim && len < size; d++)
        len += (size_t)snprintf(buf + len, size - len, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (len < size) snprintf(buf + len, size - len, ")");
}

// ---------------------------------------------------------------------------- config comparison

// Keys that may differ in [model], [moe] and [mtp] without making the tensors another model's: the init
// (used only before step 1) and the loss and balancer weights of training.
static const char *const TRAINING_ONLY_KEYS[] = {"model.init_std", "moe.bias_update_speed", "moe.balance_loss_alpha",
                                                 "mtp.loss_weight"};

static int key_must_match(const char *key) {
    if (strncmp(key, "model.", 6) && strncmp(key, "moe.", 4) && strncmp(key, "mtp.", 4)) return 0;
    for (size_t i = 0; i < sizeof TRAINING_ONLY_KEYS / sizeof *TRAINING_ONLY_KEYS; i++)
        if (!strcmp(key, TRAINING_ONLY_KEYS[i])) return 0;
    return 1;
}

// The value of "section.key" in config_print text (a malloc'd copy), or NULL.
static char *config_value(const char *text, const char *key) {
    const char *dot = strchr(key, '.');
    if (!dot) return NULL;
    char section[64];
    snprintf(section, sizeof section, "[%.*s]", (int)(dot - key), key);
    const char *name = dot + 1;
    int in_section = 0;
    for (const char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        const size_t len = strcspn(line, "\n");
        if (line[0] == '[') in_section = len == strlen(section) && !strncmp(line, section, len);
        else if (in_section && !strncmp(line, name, strlen(name)) && !strncmp(line + strlen(name), " = ", 3)) {
            const char *v = line + strlen(name) + 3;
            return strndup(v, len - (size_t)(v - line));
        }
    }
    return NULL;
}

int checkpoint_config_changes(const Config *saved, const Config *now, int incompatible_only, char *out,
                              size_t out_size) {
    char *a = h5io_config_text(saved), *b = h5io_config_text(now);
    int count = 0;
    size_t len = 0;
    if (out_size) out[0] = '\0';
    if (!a || !b) {
        free(a);
        free(b);
        if (out_size) snprintf(out, out_size, "(out of memory comparing the configs)");
        return 1;
    }
    char section[64] = "";
    for (const char *line = b; *line; line += strcspn(line, "\n") + (line[strcspn(line, "\n")] != '\0')) {
        const size_t n = strcspn(line, "\n");
        if (line[0] == '[') {
            snprintf(section, sizeof section, "%.*s", (int)(n > 2 ? n - 2 : 0), line + 1);
            continue;
        }
        const char *eq = strstr(line, " = ");
        if (!eq || eq - line >= (ptrdiff_t)n || line[0] == ';') continue;
        char key[160];
        snprintf(key, sizeof key, "%s.%.*s", section, (int)(eq - line), line);
        if (incompatible_only && !key_must_match(key)) continue;
        char *va = config_value(a, key), *vb = strndup(eq + 3, n - (size_t)(eq + 3 - line));
        if (vb && (!va || strcmp(va, vb) != 0)) {
            if (len < out_size)
                len += (size_t)snprintf(out + len, out_size - len, "%s%s = %s -> %s", count ? "; " : "", key,
                                        va ? va : "(absent)", vb);
            count++;
        }
        free(va);
        free(vb);
    }
    free(a);
    free(b);
    return count;
}

// ---------------------------------------------------------------------------- writing a rank file

// What this rank writes (index REGION_DENSE / REGION_EXPERTS): each tensor and moment element once in the job.
typedef struct {
    int weights[2];  // FP32 weights of the non-expert tensors (+ router biases) / of this rank's experts
    int moments[2];  // AdamW m and v of the region (the whole part, or with ZeRO-1 this rank's shard)
} Roles;

static Roles roles_of(const TrainState *ts, const Where *w) {
    Roles r;
    r.weights[REGION_DENSE] = w->me.dp_rank == 0;    // the dp replicas of a stage hold the same non-expert tensors
    r.weights[REGION_EXPERTS] = w->me.edp_rank == 0; // the edp replicas hold the same experts
    for (int k = 0; k < 2; k++) r.moments[k] = ts->zero1 ? ts->regions[k].n > 0 : r.weights[k];
    return r;
}

static int has_state(const Roles *r) { return r->weights[0] || r->weights[1] || r->moments[0] || r->moments[1]; }

static void rank_file_name(char *buf, size_t size, const Where *w, int world_rank) {
    RankCoords c = layout_coords(&w->layout, world_rank);
    snprintf(buf, size, "rank%05d-stage%d-dp%d-ep%d.h5", world_rank, c.stage, c.dp_rank, c.ep_rank);
}

// Largest tensor of the model (staging buffers).
static int64_t max_tensor_numel(const Model *m) {
    int64_t n = m->cfg.moe.n_routed_experts;
    for (int p = 0; p < m->n_params; p++)
        if (m->params[p].numel > n) n = m->params[p].numel;
    return n;
}

static int write_weights(const Model *m, hid_t file, const char *path, const Roles *roles, char *err,
                         size_t err_size) {
    const int64_t max_n = max_tensor_numel(m);
    real *host = malloc((size_t)max_n * sizeof *host);
    float *stage = malloc((size_t)max_n * sizeof *stage);
    int rc = -1;
    if (!host || !stage) {
        snprintf(err, err_size, "%s: out of memory staging %lld values", path, (long long)max_n);
        goto done;
    }
    if ((roles->weights[0] || roles->weights[1]) && make_group(file, path, "weights", err, err_size) != 0) goto done;
    for (int i = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i];
        if (!roles->weights[p->is_expert ? REGION_EXPERTS : REGION_DENSE]) continue;
        device_memcpy_to_host(m->rc.dev, host, m->weights + p->offset, (size_t)p->numel * sizeof *host);
        for (int64_t j = 0; j < p->numel; j++) stage[j] = (float)host[j];
        hsize_t dims[3];
        int64_t shape[3], offset[3] = {0, 0, 0};
        for (int d = 0; d < p->ndim; d++) dims[d] = (hsize_t)p->shape[d], shape[d] = p->shape[d];
        const H5I64Attr attrs[2] = {{"global_shape", shape, p->ndim}, {"offset", offset, p->ndim}};
        char name[MODEL_NAME_MAX + 16];
        snprintf(name, sizeof name, "weights/%s", p->name);
        if (write_dataset(file, path, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, p->ndim, dims, stage, attrs, 2, err,
                          err_size) != 0)
            goto done;
    }
    if (roles->weights[REGION_DENSE] && m->n_moe_layers > 0) {  // the balancer's state: every rank holds it all
        const int E = m->cfg.moe.n_routed_experts;
        if (make_group(file, path, "router_bias", err, err_size) != 0) goto done;
        for (int l = 0; l < m->n_moe_layers; l++) {
            device_memcpy_to_host(m->rc.dev, host, m->router_bias + (int64_t)l * E, (size_t)E * sizeof *host);
            for (int e = 0; e < E; e++) stage[e] = (float)host[e];
            const hsize_t dims = (hsize_t)E;
            const int64_t shape = E, offset = 0;
            const H5I64Attr attrs[2] = {{"global_shape", &shape, 1}, {"offset", &offset, 1}};  // arrays of one
            char name[MODEL_NAME_MAX + 16];
            snprintf(name, sizeof name, "router_bias/%s", m->router_bias_names[l]);
            if (write_dataset(file, path, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, 1, &dims, stage, attrs, 2, err,
                              err_size) != 0)
                goto done;
        }
    }
    rc = 0;
done:
    free(host);
    free(stage);
    return rc;
}

// Each tensor's part of the region's elements [lo, lo + n): /adam_m/<name> and /adam_v/<name>, the whole tensor
// in its shape or a run of its row-major elements from flat_offset.
static int write_moments(const TrainState *ts, hid_t file, const char *path, const Roles *roles, hid_t bf16,
                         char *err, size_t err_size) {
    const Model *m = &ts->model;
    int rc = -1;
    uint16_t *mv[2] = {NULL, NULL};
    if ((roles->moments[0] || roles->moments[1]) &&
        (make_group(file, path, "adam_m", err, err_size) != 0 || make_group(file, path, "adam_v", err, err_size) != 0))
        return -1;
    for (int k = 0; k < 2; k++) {
        const TrainedRegion *r = &ts->regions[k];
        if (!roles->moments[k] || r->n == 0) continue;
        for (int q = 0; q < 2; q++) {
            if (!(mv[q] = malloc((size_t)r->n * sizeof(uint16_t)))) {
                snprintf(err, err_size, "%s: out of memory staging %lld AdamW moments", path, (long long)r->n);
                goto done;
            }
            device_memcpy_to_host(r->opt.dev, mv[q], q ? r->opt.v : r->opt.m, (size_t)r->n * sizeof(uint16_t));
        }
        for (int i = 0; i < m->n_params; i++) {
            const ParamInfo *p = &m->params[i];
            const int64_t a = p->offset > r->lo ? p->offset : r->lo;
            const int64_t b = p->offset + p->numel < r->lo + r->n ? p->offset + p->numel : r->lo + r->n;
            if (b <= a) continue;
            int64_t shape[3], flat = a - p->offset;
            for (int d = 0; d < p->ndim; d++) shape[d] = p->shape[d];
            hsize_t dims[3] = {(hsize_t)(b - a)};
            int ndim = 1;
            if (b - a == p->numel) {
                ndim = p->ndim;
                for (int d = 0; d < ndim; d++) dims[d] = (hsize_t)p->shape[d];
            }
            const H5I64Attr attrs[2] = {{"global_shape", shape, p->ndim}, {"flat_offset", &flat, H5IO_SCALAR}};
            for (int q = 0; q < 2; q++) {
                char name[MODEL_NAME_MAX + 16];
                snprintf(name, sizeof name, "%s/%s", q ? "adam_v" : "adam_m", p->name);
                if (write_dataset(file, path, name, bf16, bf16, 2, ndim, dims, mv[q] + (a - r->lo), attrs, 2, err,
                                  err_size) != 0)
                    goto done;
            }
        }
        free(mv[0]), free(mv[1]);
        mv[0] = mv[1] = NULL;
    }
    rc = 0;
done:
    free(mv[0]);
    free(mv[1]);
    return rc;
}

// This rank's file at path (inside the temporary directory). Returns 0, or -1 with err.
static int write_rank_file(const TrainState *ts, const Where *w, const char *path, const Roles *roles, char *err,
                           size_t err_size) {
    int rc = -1;
    hid_t bf16 = bf16_type(), file = -1;
    if (bf16 < 0) {
        snprintf(err, err_size, "%s: cannot make the HDF5 BF16 type", path);
        goto done;
    }
    if ((file = h5io_create(path, 1, err, err_size)) < 0) goto done;
    const int64_t step = ts->step, coords[5] = {w->world->rank, w->me.stage, w->me.dp_rank, w->me.ep_rank,
                                                w->me.edp_rank};
    static const char *const coord_names[5] = {"world_rank", "stage", "dp_rank", "ep_rank", "edp_rank"};
    if (h5io_write_string_attr(file, path, "format", CHECKPOINT_FORMAT, err, err_size) != 0 ||
        h5io_write_i64_attr(file, path, "root group", "step", &step, H5IO_SCALAR, err, err_size) != 0)
        goto done;
    for (int c = 0; c < 5; c++)
        if (h5io_write_i64_attr(file, path, "root group", coord_names[c], &coords[c], H5IO_SCALAR, err, err_size) != 0)
            goto done;
    if (write_weights(&ts->model, file, path, roles, err, err_size) != 0) goto done;
    if (write_moments(ts, file, path, roles, bf16, err, err_size) != 0) goto done;
    if (h5io_finish(&file, path, err, err_size) != 0) goto done;
    rc = 0;
done:
    h5io_abandon(file);
    h5io_close(bf16, H5Tclose);
    return rc;
}

// ---------------------------------------------------------------------------- the manifest

// One row of /files: a rank file, its size and who wrote it.
typedef struct {
    char name[CK_FILE_NAME_MAX];
    int64_t bytes;
    int32_t world_rank, stage, dp_rank, ep_rank, edp_rank;
} FileEntry;

static hid_t file_entry_type(void) {
    hid_t str = H5Tcopy(H5T_C_S1), t = H5Tcreate(H5T_COMPOUND, sizeof(FileEntry));
    int ok = str >= 0 && t >= 0 && H5Tset_size(str, CK_FILE_NAME_MAX) >= 0 && H5Tset_strpad(str, H5T_STR_NULLTERM) >= 0 &&
             H5Tinsert(t, "name", HOFFSET(FileEntry, name), str) >= 0 &&
             H5Tinsert(t, "bytes", HOFFSET(FileEntry, bytes), H5T_NATIVE_INT64) >= 0 &&
             H5Tinsert(t, "world_rank", HOFFSET(FileEntry, world_rank), H5T_NATIVE_INT32) >= 0 &&
             H5Tinsert(t, "stage", HOFFSET(FileEntry, stage), H5T_NATIVE_INT32) >= 0 &&
             H5Tinsert(t, "dp_rank", HOFFSET(FileEntry, dp_rank), H5T_NATIVE_INT32) >= 0 &&
             H5Tinsert(t, "ep_rank", HOFFSET(FileEntry, ep_rank), H5T_NATIVE_INT32) >= 0 &&
             H5Tinsert(t, "edp_rank", HOFFSET(FileEntry, edp_rank), H5T_NATIVE_INT32) >= 0;
    h5io_close(str, H5Tclose);
    if (!ok) {
        h5io_close(t, H5Tclose);
        return -1;
    }
    return t;
}

static int write_manifest(const TrainState *ts, const Where *w, const char *path, const FileEntry *files, int n_files,
                          const LoaderCursor *cursors, char *err, size_t err_size) {
    int rc = -1;
    char *text = h5io_config_text(ts->cfg);
    hid_t ftype = file_entry_type(), file = -1;
    uint64_t *cur = malloc((size_t)w->layout.dp * 2 * sizeof *cur);
    if (!text || ftype < 0 || !cur) {
        snprintf(err, err_size, "%s: out of memory (or HDF5 type setup failed) writing the manifest", path);
        goto done;
    }
    if ((file = h5io_create(path, 1, err, err_size)) < 0) goto done;
    const int64_t ints[] = {ts->step, ts->total_steps, ts->tokens_per_step, w->layout.world, w->layout.pp,
                            w->layout.dp, w->layout.ep, w->layout.edp, ts->zero1};
    static const char *const names[] = {"step", "total_steps", "tokens_per_step", "world", "pp", "dp", "ep", "edp",
                                        "zero1"};
    if (h5io_write_string_attr(file, path, "format", CHECKPOINT_FORMAT, err, err_size) != 0 ||
        h5io_write_string_attr(file, path, "config", text, err, err_size) != 0 ||
        h5io_write_string_attr(file, path, "rng", "none kept: every draw is counter-based (kernels/rng.h), keyed by "
                               "train.seed of the config and the loader cursor's epoch", err, err_size) != 0)
        goto done;
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++)
        if (h5io_write_i64_attr(file, path, "root group", names[i], &ints[i], H5IO_SCALAR, err, err_size) != 0)
            goto done;
    const hsize_t nf = (hsize_t)n_files;
    if (n_files > 0 && write_dataset(file, path, "files", ftype, ftype, sizeof(FileEntry), 1, &nf, files, NULL, 0, err,
                                     err_size) != 0)
        goto done;
    for (int d = 0; d < w->layout.dp; d++) cur[2 * d] = cursors[d].epoch, cur[2 * d + 1] = cursors[d].position;
    const hsize_t cdims[2] = {(hsize_t)w->layout.dp, 2};
    if (make_group(file, path, "loader", err, err_size) != 0 ||
        write_dataset(file, path, "loader/train_cursor", H5T_STD_U64LE, H5T_NATIVE_UINT64, 8, 2, cdims, cur, NULL, 0,
                      err, err_size) != 0)
        goto done;
    if (h5io_finish(&file, path, err, err_size) != 0) goto done;
    rc = 0;
done:
    h5io_abandon(file);
    h5io_close(ftype, H5Tclose);
    free(cur);
    free(text);
    return rc;
}

// ---------------------------------------------------------------------------- directory steps of a save

static int remove_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(p) == 0 || errno == ENOENT ? 0 : -1;
}

// rm -r path (nothing there is not an error). Returns 0, or -1 with errno.
static int remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : -1;
    return nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

// The step of a complete checkpoint's name "step_<digits>" (nothing after the digits), else -1.
static long step_of_name(const char *name) {
    if (strncmp(name, "step_", 5) != 0 || !name[5]) return -1;
    long step = 0;
    for (const char *c = name + 5; *c; c++) {
        if (*c < '0' || *c > '9' || step > 100000000000L) return -1;
        step = step * 10 + (*c - '0');
    }
    return step;
}

// What a killed save leaves: "step_<digits>.tmp" (the checkpoint being written), "latest.tmp.<digits>".
static int is_partial_name(const char *name) {
    const size_t n = strlen(name);
    if (n > 9 && !strncmp(name, "step_", 5) && !strcmp(name + n - 4, ".tmp")) {
        for (size_t i = 5; i < n - 4; i++)
            if (name[i] < '0' || name[i] > '9') return 0;
        return 1;
    }
    if (!strncmp(name, "latest.tmp.", 11) && name[11]) {
        for (const char *c = name + 11; *c; c++)
            if (*c < '0' || *c > '9') return 0;
        return 1;
    }
    return 0;
}

// World rank 0, first step of a save: DIR made, partial checkpoints removed, the temporary directory made.
static int prepare_dir(const char *dir, const char *tmp, char *err, size_t err_size) {
    if (durable_make_dirs(dir, err, err_size) != 0) return -1;
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, err_size, "%s: cannot list the checkpoint directory: %s", dir, strerror(errno));
        return -1;
    }
    for (struct dirent *e; (e = readdir(d));) {
        if (!is_partial_name(e->d_name)) continue;
        char p[CK_PATH];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (remove_tree(p) != 0) {
            snprintf(err, err_size, "%s: cannot remove this partial checkpoint of an interrupted save: %s", p,
                     strerror(errno));
            closedir(d);
            return -1;
        }
        printf("checkpoint: removed %s, left by an interrupted save\n", p);
    }
    closedir(d);
    if (mkdir(tmp, 0755) != 0) {
        snprintf(err, err_size, "%s: cannot make the temporary checkpoint directory: %s", tmp, strerror(errno));
        return -1;
    }
    return 0;
}

// Renames the finished temporary directory to its final name and fsyncs DIR. An existing checkpoint of the same
// step is exchanged with it in one atomic step (DIR/latest may point at it), then removed.
static int install_dir(const char *tmp, const char *final, const char *dir, char *err, size_t err_size) {
    if (rename(tmp, final) != 0) {
        if (errno != EEXIST && errno != ENOTEMPTY) {
            snprintf(err, err_size, "%s: cannot rename %s to it: %s", final, tmp, strerror(errno));
            return -1;
        }
        if (renameat2(AT_FDCWD, tmp, AT_FDCWD, final, RENAME_EXCHANGE) != 0) {
            snprintf(err, err_size, "%s: a checkpoint of this step exists and cannot be replaced atomically "
                     "(renameat2 RENAME_EXCHANGE: %s); remove it to save again", final, strerror(errno));
            return -1;
        }
        if (remove_tree(tmp) != 0)  // now the earlier checkpoint of this step
            fprintf(stderr, "fp8moe: warning: %s: cannot remove the replaced checkpoint: %s\n", tmp, strerror(errno));
    }
    if (durable_fsync_path(dir) != 0) {
        snprintf(err, err_size, "%s: written, but the fsync of %s failed: %s (it may not survive a crash)", final, dir,
                 strerror(errno));
        return -1;
    }
    return 0;
}

// DIR/latest -> name, replaced by renaming a new symlink over it.
static int point_latest(const char *dir, const char *name, char *err, size_t err_size) {
    char tmp[CK_PATH], latest[CK_PATH];
    snprintf(tmp, sizeof tmp, "%s/latest.tmp.%ld", dir, (long)getpid());
    snprintf(latest, sizeof latest, "%s/%s", dir, CHECKPOINT_LATEST);
    unlink(tmp);
    if (symlink(name, tmp) != 0) {
        snprintf(err, err_size, "%s: cannot make the symlink to %s: %s", tmp, name, strerror(errno));
        return -1;
    }
    const int renamed = durable_rename(tmp, latest);
    if (renamed == -1) {
        snprintf(err, err_size, "%s: cannot replace it with a link to %s: %s", latest, name, strerror(errno));
        unlink(tmp);
        return -1;
    }
    if (renamed == -2) {
        snprintf(err, err_size, "%s: points at %s, but the fsync of %s failed: %s", latest, name, dir, strerror(errno));
        return -1;
    }
    return 0;
}

typedef struct {
    long step;
    char name[256];  // a directory entry's name (NAME_MAX + 1)
} StepDir;

static int compare_step_desc(const void *a, const void *b) {
    const long x = ((const StepDir *)a)->step, y = ((const StepDir *)b)->step;
    return x < y ? 1 : x > y ? -1 : 0;
}

// Removes the step_* checkpoints beyond keep_last: the new one (step `kept`) counts as one and stays, then the
// highest steps. Failures are warnings: the new checkpoint is complete.
static void prune(const char *dir, int keep_last, long kept) {
    if (keep_last <= 0) return;
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "fp8moe: warning: %s: cannot list it to prune old checkpoints: %s\n", dir, strerror(errno));
        return;
    }
    StepDir *steps = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        const long s = step_of_name(e->d_name);
        if (s < 0 || s == kept) continue;
        if (n == cap) {
            StepDir *grown = realloc(steps, (cap = cap ? 2 * cap : 16) * sizeof *steps);
            if (!grown) break;
            steps = grown;
        }
        steps[n].step = s;
        snprintf(steps[n++].name, sizeof steps->name, "%s", e->d_name);
    }
    closedir(d);
    if (n > 0) qsort(steps, n, sizeof *steps, compare_step_desc);
    for (size_t i = (size_t)(keep_last - 1); i < n; i++) {
        char p[CK_PATH];
        snprintf(p, sizeof p, "%s/%s", dir, steps[i].name);
        if (remove_tree(p) != 0)
            fprintf(stderr, "fp8moe: warning: %s: cannot remove this old checkpoint: %s\n", p, strerror(errno));
        else printf("checkpoint: removed %s (keep_last = %d)\n", p, keep_last);
    }
    free(steps);
}

// ---------------------------------------------------------------------------- checkpoint_save

int checkpoint_save(const TrainState *ts, const Groups *groups, const char *dir, int keep_last, char *err,
                    size_t err_size) {
    const Where w = where_of(groups);
    Comm *world = w.world;
    char step_name[32], final[CK_PATH], tmp[CK_PATH], file[CK_PATH], manifest[CK_PATH], fname[CK_FILE_NAME_MAX];
    snprintf(step_name, sizeof step_name, "step_%08d", ts->step);
    rank_file_name(fname, sizeof fname, &w, world->rank);
    snprintf(final, sizeof final, "%s/%s", dir, step_name);
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, step_name);
    int failed = snprintf(manifest, sizeof manifest, "%s/%s", tmp, CHECKPOINT_MANIFEST) >= (int)sizeof manifest ||
                 snprintf(file, sizeof file, "%s/%s", tmp, fname) >= (int)sizeof file;
    if (failed) snprintf(err, err_size, "%s: path too long for a checkpoint directory", dir);
    if (agree(world, failed, err, err_size) != 0) return -1;

    H5ErrorPrinting saved;
    h5io_quiet(&saved);
    int rc = -1, made_tmp = 0;
    LoaderCursor *cursors = malloc((size_t)world->size * sizeof *cursors);
    int64_t *sizes = malloc((size_t)world->size * sizeof *sizes);
    FileEntry *files = calloc((size_t)world->size, sizeof *files);
    LoaderCursor *dp_cursors = malloc((size_t)w.layout.dp * sizeof *dp_cursors);
    failed = !cursors || !sizes || !files || !dp_cursors;
    if (failed) snprintf(err, err_size, "%s: out of memory for the checkpoint's file table", dir);
    if (!failed && world->rank == 0) failed = prepare_dir(dir, tmp, err, err_size) != 0;
    if (agree(world, failed, err, err_size) != 0) goto done;
    made_tmp = 1;

    // the loader cursor is the same on every rank (data/loader.h); one that differs is a bug, not a checkpoint
    const LoaderCursor mine = loader_get_cursor(&ts->train);
    comm_allgather_bytes(world, &mine, cursors, sizeof mine);
    for (int r = 0; r < world->size && !failed; r++)
        if (cursors[r].epoch != mine.epoch || cursors[r].position != mine.position) {
            snprintf(err, err_size, "%s: the training loader's cursor differs between ranks: {epoch %llu, position %llu} "
                     "on rank %d, {%llu, %llu} here", dir, (unsigned long long)cursors[r].epoch,
                     (unsigned long long)cursors[r].position, r, (unsigned long long)mine.epoch,
                     (unsigned long long)mine.position);
            failed = 1;
        }
    const Roles roles = roles_of(ts, &w);
    int64_t bytes = -1;
    if (!failed && has_state(&roles)) {
        failed = write_rank_file(ts, &w, file, &roles, err, err_size) != 0;
        struct stat st;
        if (!failed && stat(file, &st) != 0) {
            snprintf(err, err_size, "%s: written, but stat fails: %s", file, strerror(errno));
            failed = 1;
        }
        if (!failed) bytes = (int64_t)st.st_size;
        fault_point("save", (int)ts->step, world->rank);  // the crash tests' SIGKILL inside a save (train/fault.h)
    }
    if (agree(world, failed, err, err_size) != 0) goto done;
    comm_allgather_bytes(world, &bytes, sizes, sizeof bytes);

    if (world->rank == 0) {
        int n_files = 0;
        for (int r = 0; r < world->size; r++) {
            if (sizes[r] < 0) continue;
            FileEntry *f = &files[n_files++];
            const RankCoords c = layout_coords(&w.layout, r);
            *f = (FileEntry){.bytes = sizes[r], .world_rank = r, .stage = c.stage, .dp_rank = c.dp_rank,
                             .ep_rank = c.ep_rank, .edp_rank = c.edp_rank};
            rank_file_name(f->name, sizeof f->name, &w, r);
        }
        for (int d = 0; d < w.layout.dp; d++) dp_cursors[d] = cursors[layout_world_rank(&w.layout, 0, d)];
        failed = write_manifest(ts, &w, manifest, files, n_files, dp_cursors, err, err_size) != 0;
        if (!failed && durable_fsync_path(tmp) != 0) {
            snprintf(err, err_size, "%s: cannot fsync the directory: %s", tmp, strerror(errno));
            failed = 1;
        }
        if (!failed) failed = install_dir(tmp, final, dir, err, err_size) != 0;
        if (!failed) failed = point_latest(dir, step_name, err, err_size) != 0;
        if (!failed) prune(dir, keep_last, ts->step);
        fflush(stdout);
    }
    if (agree(world, failed, err, err_size) != 0) goto done;
    rc = 0;
done:
    if (rc != 0 && made_tmp && world->rank == 0 && remove_tree(tmp) != 0)
        fprintf(stderr, "fp8moe: warning: %s: cannot remove the partial checkpoint: %s\n", tmp, strerror(errno));
    free(dp_cursors);
    free(files);
    free(sizes);
    free(cursors);
    h5io_restore(&saved);
    return rc;
}

// ---------------------------------------------------------------------------- reading the manifest

enum { M_STEP, M_TOTAL_STEPS, M_TOKENS_PER_STEP, M_WORLD, M_PP, M_DP, M_EP, M_EDP, M_ZERO1, M_N };
static const char *const MANIFEST_INTS[M_N] = {"step", "total_steps", "tokens_per_step", "world", "pp", "dp", "ep",
                                               "edp", "zero1"};

typedef struct {
    char dir[CHECKPOINT_DIR_MAX];  // the checkpoint (a step directory)
    char path[CK_PATH];   // its manifest
    int64_t ints[M_N];
    Config cfg;
    FileEntry *files;
    int n_files;
    LoaderCursor *cursors;  // (dp)
} Manifest;

static void manifest_free(Manifest *man) {
    free(man->files);
    free(man->cursors);
    man->files = NULL;
    man->cursors = NULL;
}

// The target of symlink (or the first line of the small file) `link`, joined to link's directory when relative.
static int follow_latest(const char *link, char *out, size_t out_size, char *err, size_t err_size) {
    char target[CK_PATH];
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0 && errno == EINVAL) {  // a regular file naming the checkpoint
        FILE *f = fopen(link, "r");
        n = f && fgets(target, sizeof target, f) ? (ssize_t)strcspn(target, "\r\n") : -1;
        if (f) fclose(f);
    }
    if (n <= 0) {
        snprintf(err, err_size, "%s: cannot read where it points: %s", link, n < 0 ? strerror(errno) : "empty");
        return -1;
    }
    target[n] = '\0';
    const char *slash = strrchr(link, '/');
    const int keep = target[0] == '/' || !slash ? 0 : (int)(slash - link + 1);
    if (snprintf(out, out_size, "%.*s%s", keep, link, target) >= (int)out_size) {
        snprintf(err, err_size, "%s: the path it points at is too long", link);
        return -1;
    }
    return 0;
}

// path (a checkpoint, DIR/latest, or a checkpoint directory DIR) -> the step directory holding manifest.h5.
static int resolve_checkpoint(const char *path, char *dir, size_t dir_size, char *err, size_t err_size) {
    char p[CK_PATH], m[CK_PATH + 16];
    snprintf(p, sizeof p, "%s", path);
    for (size_t n = strlen(p); n > 1 && p[n - 1] == '/'; n--) p[n - 1] = '\0';
    struct stat st;
    if (lstat(p, &st) == 0 && S_ISLNK(st.st_mode)) {  // DIR/latest itself: name the step directory in messages
        char q[CK_PATH];
        if (follow_latest(p, q, sizeof q, err, err_size) != 0) return -1;
        snprintf(p, sizeof p, "%s", q);
    }
    if (snprintf(m, sizeof m, "%s/%s", p, CHECKPOINT_MANIFEST) >= (int)sizeof m) {
        snprintf(err, err_size, "%s: path too long", p);
        return -1;
    }
    if (stat(m, &st) != 0) {
        char latest[CK_PATH + 16];
        snprintf(latest, sizeof latest, "%s/%s", p, CHECKPOINT_LATEST);
        if (lstat(latest, &st) == 0) {
            char q[CK_PATH];
            if (follow_latest(latest, q, sizeof q, err, err_size) != 0) return -1;
            snprintf(p, sizeof p, "%s", q);
        } else if (stat(p, &st) != 0) {
            snprintf(err, err_size, "%s: cannot read the checkpoint: %s", p, strerror(errno));
            return -1;
        } else {
            snprintf(err, err_size, "%s: neither a checkpoint (no %s) nor a checkpoint directory (no %s)", p,
                     CHECKPOINT_MANIFEST, CHECKPOINT_LATEST);
            return -1;
        }
    }
    const size_t n = strlen(p);
    if (n >= 4 && !strcmp(p + n - 4, ".tmp")) {
        snprintf(err, err_size, "%s: a partial checkpoint (its save did not finish); load a step_NNNNNNNN directory or "
                 "the checkpoint directory's %s", p, CHECKPOINT_LATEST);
        return -1;
    }
    if (snprintf(m, sizeof m, "%s/%s", p, CHECKPOINT_MANIFEST) >= (int)sizeof m ||
        snprintf(dir, dir_size, "%s", p) >= (int)dir_size) {
        snprintf(err, err_size, "%s: path too long", p);
        return -1;
    }
    if (stat(m, &st) != 0) {
        snprintf(err, err_size, "%s: %s (not a complete checkpoint)", m, strerror(errno));
        return -1;
    }
    return 0;
}

static int read_manifest(const char *path, Manifest *man, char *err, size_t err_size) {
    memset(man, 0, sizeof *man);
    if (resolve_checkpoint(path, man->dir, sizeof man->dir, err, err_size) != 0) return -1;
    snprintf(man->path, sizeof man->path, "%s/%s", man->dir, CHECKPOINT_MANIFEST);
    const char *mp = man->path;
    int rc = -1, ndim;
    char *format = NULL, *text = NULL;
    hsize_t dims[H5S_MAX_RANK];
    hid_t ftype = file_entry_type(), dset = -1, file = h5io_open_for_reading(mp, "checkpoint manifest", err, err_size);
    if (file < 0 || ftype < 0) goto done;
    if (h5io_read_string_attr(file, mp, "format", &format, err, err_size) != 0) goto done;
    if (strcmp(format, CHECKPOINT_FORMAT) != 0) {
        snprintf(err, err_size, "%s: root attribute \"format\" is \"%.64s\", expected \"%s\"", mp, format,
                 CHECKPOINT_FORMAT);
        goto done;
    }
    for (int i = 0; i < M_N; i++)
        if (read_i64_attr(file, mp, "root group", MANIFEST_INTS[i], &man->ints[i], 1, err, err_size) != 0) goto done;
    const int64_t dp = man->ints[M_DP];
    if (dp < 1 || dp > man->ints[M_WORLD] || man->ints[M_STEP] < 0 || man->ints[M_STEP] > 2000000000) {
        snprintf(err, err_size, "%s: attributes dp = %lld, world = %lld, step = %lld are not a layout and step", mp,
                 (long long)dp, (long long)man->ints[M_WORLD], (long long)man->ints[M_STEP]);
        goto done;
    }
    if (h5io_read_string_attr(file, mp, "config", &text, err, err_size) != 0) goto done;
    char cerr[1024];
    config_defaults(&man->cfg);
    if (config_load_string(&man->cfg, mp, text, NULL, 0, cerr, sizeof cerr) != 0) {
        snprintf(err, err_size, "%s: root attribute \"config\" does not parse: %s", mp, cerr);
        goto done;
    }
    if ((dset = open_dataset(file, mp, "files", &ndim, dims, err, err_size)) < 0) goto done;
    if (ndim != 1 || dims[0] < 1 || dims[0] > (hsize_t)man->ints[M_WORLD]) {
        snprintf(err, err_size, "%s: dataset /files: expected 1 to %lld rows", mp, (long long)man->ints[M_WORLD]);
        goto done;
    }
    man->n_files = (int)dims[0];
    if (!(man->files = calloc((size_t)man->n_files, sizeof *man->files)) ||
        !(man->cursors = calloc((size_t)dp, sizeof *man->cursors))) {
        snprintf(err, err_size, "%s: out of memory", mp);
        goto done;
    }
    if (read_dataset(dset, ftype, man->files, mp, "files", err, err_size) != 0) goto done;
    H5Dclose(dset);
    if ((dset = open_dataset(file, mp, "loader/train_cursor", &ndim, dims, err, err_size)) < 0) goto done;
    if (ndim != 2 || dims[0] != (hsize_t)dp || dims[1] != 2) {
        snprintf(err, err_size, "%s: dataset /loader/train_cursor: expected shape (%lld, 2)", mp, (long long)dp);
        goto done;
    }
    uint64_t *cur = calloc((size_t)dp * 2, sizeof *cur);
    if (!cur || read_dataset(dset, H5T_NATIVE_UINT64, cur, mp, "loader/train_cursor", err, err_size) != 0) {
        if (!cur) snprintf(err, err_size, "%s: out of memory", mp);
        free(cur);
        goto done;
    }
    for (int64_t d = 0; d < dp; d++) man->cursors[d] = (LoaderCursor){cur[2 * d], cur[2 * d + 1]};
    free(cur);
    for (int i = 0; i < man->n_files; i++) {
        FileEntry *f = &man->files[i];
        f->name[CK_FILE_NAME_MAX - 1] = '\0';
        if (!f->name[0] || strchr(f->name, '/') || f->bytes < 0) {
            snprintf(err, err_size, "%s: dataset /files: row %d does not name a rank file of this directory", mp, i);
            goto done;
        }
    }
    rc = 0;
done:
    h5io_close(dset, H5Dclose);
    h5io_close(ftype, H5Tclose);
    h5io_close(file, H5Fclose);
    free(format);
    free(text);
    if (rc != 0) manifest_free(man);
    return rc;
}

int checkpoint_read_info(const char *path, CheckpointInfo *info, char *err, size_t err_size) {
    H5ErrorPrinting saved;
    h5io_quiet(&saved);
    Manifest man;
    const int rc = read_manifest(path, &man, err, err_size);
    if (rc == 0) {
        memset(info, 0, sizeof *info);
        snprintf(info->dir, sizeof info->dir, "%s", man.dir);
        info->step = (int)man.ints[M_STEP];
        info->total_steps = (int)man.ints[M_TOTAL_STEPS];
        info->tokens_per_step = man.ints[M_TOKENS_PER_STEP];
        info->world = (int)man.ints[M_WORLD], info->pp = (int)man.ints[M_PP], info->dp = (int)man.ints[M_DP];
        info->ep = (int)man.ints[M_EP], info->zero1 = (int)man.ints[M_ZERO1];
        info->cursor = man.cursors[0];
        info->n_files = man.n_files;
        info->cfg = man.cfg;
        manifest_free(&man);
    }
    h5io_restore(&saved);
    return rc;
}

// ---------------------------------------------------------------------------- gathering this rank's state

typedef struct {
    int64_t lo, hi;
} Span;

typedef struct {
    Span *s;
    int n, cap;
} Spans;

// What checkpoint_load collects from the rank files before it commits: weights go to the device as they are
// read; moments are assembled on the host (this rank's regions), with the spans of the flat buffer found.
// checkpoint_load_model gathers into a bare model: ts is NULL and moments are not read.
typedef struct {
    TrainState *ts;             // NULL: weights and router biases only
    Model *m;                   // the model the weights go to (ts's, or a bare one)
    const ParamInfo **by_name;  // the model's tensors sorted by name
    char *weight_found;         // per tensor (index into model.params)
    char *bias_found;           // per MoE layer
    uint16_t *mom[2][2];        // [region][m, v]: regions[k].n host values
    Spans got[2][2];
    float *stage;
    real *host;
    uint16_t *raw;
    hid_t bf16;
} Gather;

static int compare_param_name(const void *a, const void *b) {
    return strcmp((*(const ParamInfo *const *)a)->name, (*(const ParamInfo *const *)b)->name);
}
static int compare_name_key(const void *key, const void *elem) {
    return strcmp((const char *)key, (*(const ParamInfo *const *)elem)->name);
}

static const ParamInfo *find_param(const Gather *G, const char *name) {
    const ParamInfo *const *p = bsearch(name, G->by_name, (size_t)G->m->n_params, sizeof *G->by_name,
                                        compare_name_key);
    return p ? *p : NULL;
}

// Tensor p's elements that region k holds here, as the flat-buffer range [*a, *b) (empty: *b <= *a).
static void region_part(const TrainedRegion *r, const ParamInfo *p, int64_t *a, int64_t *b) {
    *a = p->offset > r->lo ? p->offset : r->lo;
    *b = p->offset + p->numel < r->lo + r->n ? p->offset + p->numel : r->lo + r->n;
}

static int spans_add(Spans *s, int64_t lo, int64_t hi) {
    if (s->n == s->cap) {
        Span *grown = realloc(s->s, (size_t)(s->cap = s->cap ? 2 * s->cap : 64) * sizeof *grown);
        if (!grown) return -1;
        s->s = grown;
    }
    s->s[s->n++] = (Span){lo, hi};
    return 0;
}

static int compare_span(const void *a, const void *b) {
    const Span *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

// Sorts and merges the spans in place (touching or overlapping spans become one).
static void spans_merge(Spans *s) {
    if (s->n == 0) return;  // (s->s may be NULL: qsort must not see it)
    qsort(s->s, (size_t)s->n, sizeof *s->s, compare_span);
    int w = 0;
    for (int i = 1; i < s->n; i++) {
        if (s->s[i].lo <= s->s[w].hi) {
            if (s->s[i].hi > s->s[w].hi) s->s[w].hi = s->s[i].hi;
        } else s->s[++w] = s->s[i];
    }
    s->n = w + 1;
}

// The first element of [a, b) that no merged span covers, or b when all are covered.
static int64_t spans_first_gap(const Spans *s, int64_t a, int64_t b) {
    for (int i = 0; i < s->n && a < b; i++) {
        if (s->s[i].hi <= a) continue;
        if (s->s[i].lo > a) return a;
        a = s->s[i].hi;
    }
    return a < b ? a : b;
}

// The dataset's shape must be the tensor's global shape, and its "global_shape" attribute too.
static int check_shape(hid_t dset, const char *fpath, const char *dname, const ParamInfo *p, int ndim,
                       const hsize_t *dims, int whole, char *err, size_t err_size) {
    int64_t want[3], attr[3];
    for (int d = 0; d < p->ndim; d++) want[d] = p->shape[d];
    char ws[64], gs[64];
    format_shape(ws, sizeof ws, p->ndim, want);
    if (read_i64_attr(dset, fpath, dname, "global_shape", attr, p->ndim, err, err_size) != 0) {
        if (strlen(err) + 80 < err_size)
            snprintf(err + strlen(err), err_size - strlen(err), " (this model's %s is %s)", p->name, ws);
        return -1;
    }
    int same = 1;
    for (int d = 0; d < p->ndim; d++) same &= attr[d] == want[d];
    if (same && whole) {
        same = ndim == p->ndim;
        for (int d = 0; same && d < ndim; d++) same = dims[d] == (hsize_t)want[d];
    }
    if (!same) {
        format_shape(gs, sizeof gs, p->ndim, attr);
        snprintf(err, err_size, "%s: dataset /%s: tensor of global shape %s%s, this model's %s is %s (a checkpoint of "
                 "another model shape?)", fpath, dname, gs, whole ? " held whole" : "", p->name, ws);
        return -1;
    }
    return 0;
}

static int take_weight(Gather *G, hid_t file, const char *fpath, const char *name, char *err, size_t err_size) {
    const ParamInfo *p = find_param(G, name);
    Model *m = G->m;
    if (!p || G->weight_found[p - m->params]) return 0;  // another rank's tensor, or a second copy
    char dname[MODEL_NAME_MAX + 32];
    snprintf(dname, sizeof dname, "weights/%s", name);
    hsize_t dims[H5S_MAX_RANK];
    int ndim, rc = -1;
    int64_t offset[3];
    hid_t dset = open_dataset(file, fpath, dname, &ndim, dims, err, err_size), type = -1;
    if (dset < 0 || check_shape(dset, fpath, dname, p, ndim, dims, 1, err, err_size) != 0) goto done;
    if (read_i64_attr(dset, fpath, dname, "offset", offset, p->ndim, err, err_size) != 0) goto done;
    for (int d = 0; d < p->ndim; d++)
        if (offset[d] != 0) {
            snprintf(err, err_size, "%s: dataset /%s: a piece at a non-zero offset (this version reads whole tensors)",
                     fpath, dname);
            goto done;
        }
    if ((type = H5Dget_type(dset)) < 0 || H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != 4) {
        snprintf(err, err_size, "%s: dataset /%s: expected FP32 values", fpath, dname);
        goto done;
    }
    if (read_dataset(dset, H5T_NATIVE_FLOAT, G->stage, fpath, dname, err, err_size) != 0) goto done;
    for (int64_t j = 0; j < p->numel; j++) G->host[j] = (real)G->stage[j];
    device_memcpy_from_host(m->rc.dev, m->weights + p->offset, G->host, (size_t)p->numel * sizeof(real));
    G->weight_found[p - m->params] = 1;
    rc = 0;
done:
    h5io_close(type, H5Tclose);
    h5io_close(dset, H5Dclose);
    return rc;
}

static int take_bias(Gather *G, hid_t file, const char *fpath, const char *name, char *err, size_t err_size) {
    Model *m = G->m;
    const int l = model_find_router_bias(m, name), E = m->cfg.moe.n_routed_experts;
    if (l < 0 || G->bias_found[l]) return 0;
    char dname[MODEL_NAME_MAX + 32];
    snprintf(dname, sizeof dname, "router_bias/%s", name);
    hsize_t dims[H5S_MAX_RANK];
    int ndim, rc = -1;
    hid_t dset = open_dataset(file, fpath, dname, &ndim, dims, err, err_size);
    if (dset < 0) goto done;
    if (ndim != 1 || dims[0] != (hsize_t)E) {
        snprintf(err, err_size, "%s: dataset /%s: expected shape (%d), one bias per routed expert", fpath, dname, E);
        goto done;
    }
    if (read_dataset(dset, H5T_NATIVE_FLOAT, G->stage, fpath, dname, err, err_size) != 0) goto done;
    for (int e = 0; e < E; e++) G->host[e] = (real)G->stage[e];
    device_memcpy_from_host(m->rc.dev, m->router_bias + (int64_t)l * E, G->host, (size_t)E * sizeof(real));
    G->bias_found[l] = 1;
    rc = 0;
done:
    h5io_close(dset, H5Dclose);
    return rc;
}

// Piece of AdamW moment q (0 = m, 1 = v) of tensor `name`: the elements this rank's regions hold are copied.
static int take_moment(Gather *G, int q, hid_t file, const char *fpath, const char *name, char *err, size_t err_size) {
    const ParamInfo *p = find_param(G, name);
    TrainState *ts = G->ts;
    if (!p || !ts) return 0;
    int64_t a[2], b[2];
    int needed = 0;
    for (int k = 0; k < 2; k++) region_part(&ts->regions[k], p, &a[k], &b[k]), needed |= b[k] > a[k];
    if (!needed) return 0;
    char dname[MODEL_NAME_MAX + 32];
    snprintf(dname, sizeof dname, "%s/%s", q ? "adam_v" : "adam_m", name);
    hsize_t dims[H5S_MAX_RANK];
    int ndim, rc = -1, have = 0;
    int64_t flat;
    hid_t dset = open_dataset(file, fpath, dname, &ndim, dims, err, err_size), type = -1;
    if (dset < 0) goto done;
    hsize_t count = 1;
    for (int d = 0; d < ndim; d++) count *= dims[d];
    const int whole = ndim != 1 || (int64_t)count == p->numel;
    if (check_shape(dset, fpath, dname, p, ndim, dims, whole && p->ndim != 1 ? 1 : 0, err, err_size) != 0) goto done;
    if (read_i64_attr(dset, fpath, dname, "flat_offset", &flat, 1, err, err_size) != 0) goto done;
    if (flat < 0 || flat + (int64_t)count > p->numel) {
        snprintf(err, err_size, "%s: dataset /%s: elements [%lld, %lld) do not fit tensor %s of %lld elements", fpath,
                 dname, (long long)flat, (long long)(flat + (int64_t)count), p->name, (long long)p->numel);
        goto done;
    }
    if ((type = H5Dget_type(dset)) < 0 || H5Tequal(type, G->bf16) <= 0) {
        snprintf(err, err_size, "%s: dataset /%s: expected BF16 values (the 16-bit float type of an fp8moe checkpoint)",
                 fpath, dname);
        goto done;
    }
    const int64_t lo = p->offset + flat, hi = lo + (int64_t)count;  // the piece in this placement's flat buffer
    for (int k = 0; k < 2; k++) {
        const TrainedRegion *r = &ts->regions[k];
        const int64_t x = lo > a[k] ? lo : a[k], y = hi < b[k] ? hi : b[k];
        if (y <= x) continue;
        if (!have && read_dataset(dset, G->bf16, G->raw, fpath, dname, err, err_size) != 0) goto done;
        have = 1;
        memcpy(G->mom[k][q] + (x - r->lo), G->raw + (x - lo), (size_t)(y - x) * sizeof(uint16_t));
        if (spans_add(&G->got[k][q], x, y) != 0) {
            snprintf(err, err_size, "%s: out of memory", fpath);
            goto done;
        }
    }
    rc = 0;
done:
    h5io_close(type, H5Tclose);
    h5io_close(dset, H5Dclose);
    return rc;
}

// Every dataset of one rank file that this rank holds.
static int take_from_file(Gather *G, const Manifest *man, const char *fpath, char *err, size_t err_size) {
    int rc = -1;
    char *format = NULL;
    int64_t step;
    hid_t grp = -1, file = h5io_open_for_reading(fpath, "checkpoint file", err, err_size);
    if (file < 0) goto done;
    if (h5io_read_string_attr(file, fpath, "format", &format, err, err_size) != 0) goto done;
    if (strcmp(format, CHECKPOINT_FORMAT) != 0) {
        snprintf(err, err_size, "%s: root attribute \"format\" is \"%.64s\", expected \"%s\"", fpath, format,
                 CHECKPOINT_FORMAT);
        goto done;
    }
    if (read_i64_attr(file, fpath, "root group", "step", &step, 1, err, err_size) != 0) goto done;
    if (step != man->ints[M_STEP]) {
        snprintf(err, err_size, "%s: written at step %lld, but %s is of step %lld (a file of another checkpoint?)", fpath,
                 (long long)step, man->path, (long long)man->ints[M_STEP]);
        goto done;
    }
    static const char *const groups[4] = {"weights", "router_bias", "adam_m", "adam_v"};
    for (int gi = 0; gi < 4; gi++) {
        const htri_t exists = H5Lexists(file, groups[gi], H5P_DEFAULT);
        if (exists == 0) continue;
        H5G_info_t info;
        if (exists < 0 || (grp = H5Gopen2(file, groups[gi], H5P_DEFAULT)) < 0 || H5Gget_info(grp, &info) < 0) {
            snprintf(err, err_size, "%s: group /%s: cannot list it%s", fpath, groups[gi],
                     h5io_checksum_failed() ? ": its metadata fails its checksum (the file is corrupted)" : "");
            goto done;
        }
        for (hsize_t i = 0; i < info.nlinks; i++) {
            char name[MODEL_NAME_MAX + 8];
            const ssize_t len = H5Lget_name_by_idx(grp, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name,
                                                   H5P_DEFAULT);
            if (len < 0 || len >= (ssize_t)sizeof name) {
                snprintf(err, err_size, "%s: group /%s: cannot read the name of its link %llu%s", fpath, groups[gi],
                         (unsigned long long)i, len < 0 && h5io_checksum_failed() ? " (checksum failure: corrupted)" : "");
                goto done;
            }
            const int took = gi == 0   ? take_weight(G, file, fpath, name, err, err_size)
                             : gi == 1 ? take_bias(G, file, fpath, name, err, err_size)
                                       : take_moment(G, gi - 2, file, fpath, name, err, err_size);
            if (took != 0) goto done;
        }
        H5Gclose(grp);
        grp = -1;
    }
    rc = 0;
done:
    free(format);
    h5io_close(grp, H5Gclose);
    h5io_close(file, H5Fclose);
    return rc;
}

// After every file: the first tensor, bias or moment element this rank needs that none held, or 0 when all were
// found. what: a description of it.
static int find_missing(Gather *G, char *what, size_t size) {
    Model *m = G->m;
    for (int i = 0; i < m->n_params; i++)
        if (!G->weight_found[i]) return snprintf(what, size, "tensor %s (FP32 weights)", m->params[i].name), 1;
    for (int l = 0; l < m->n_moe_layers; l++)
        if (!G->bias_found[l]) return snprintf(what, size, "router bias %s", m->router_bias_names[l]), 1;
    for (int k = 0; G->ts && k < 2; k++)
        for (int q = 0; q < 2; q++) {
            spans_merge(&G->got[k][q]);
            for (int i = 0; i < m->n_params; i++) {
                const ParamInfo *p = &m->params[i];
                int64_t a, b;
                region_part(&G->ts->regions[k], p, &a, &b);
                if (b <= a) continue;
                const int64_t gap = spans_first_gap(&G->got[k][q], a, b);
                if (gap < b)
                    return snprintf(what, size, "element %lld of the AdamW %s of tensor %s (this rank holds elements "
                                    "[%lld, %lld) of it)", (long long)(gap - p->offset), q ? "v" : "m", p->name,
                                    (long long)(a - p->offset), (long long)(b - p->offset)), 1;
            }
        }
    return 0;
}

static void gather_free(Gather *G) {
    free(G->by_name);
    free(G->weight_found);
    free(G->bias_found);
    for (int k = 0; k < 2; k++)
        for (int q = 0; q < 2; q++) free(G->mom[k][q]), free(G->got[k][q].s);
    free(G->stage);
    free(G->host);
    free(G->raw);
    h5io_close(G->bf16, H5Tclose);
}

// A checkpoint of another model is refused with the keys that differ.
static int check_same_model(const Manifest *man, const Config *now, char *err, size_t err_size) {
    char changes[1024];
    if (checkpoint_config_changes(&man->cfg, now, 1, changes, sizeof changes) > 0) {
        snprintf(err, err_size, "%s: the checkpoint is of another model: %s (the keys of [model], [moe] and [mtp] "
                 "must match, except model.init_std, moe.bias_update_speed, moe.balance_loss_alpha and mtp.loss_weight)",
                 man->path, changes);
        return -1;
    }
    return 0;
}

// Reads every rank file of `man` into G: the weights and router biases of G->m, and with G->ts the moment
// elements of its regions; then checks that everything needed was found. G holds only ts, m and bf16; the rest is
// allocated here (gather_free releases it).
static int gather_files(Gather *G, const Manifest *man, char *err, size_t err_size) {
    const Model *m = G->m;
    const int64_t max_n = max_tensor_numel(m);
    int n_missing = 0;
    const FileEntry *missing = NULL;
    G->by_name = malloc((size_t)m->n_params * sizeof *G->by_name);
    G->weight_found = calloc((size_t)m->n_params, 1);
    G->bias_found = calloc((size_t)(m->n_moe_layers > 0 ? m->n_moe_layers : 1), 1);
    G->stage = malloc((size_t)max_n * sizeof *G->stage);
    G->host = malloc((size_t)max_n * sizeof *G->host);
    G->raw = malloc((size_t)max_n * sizeof *G->raw);
    int ok = G->bf16 >= 0 && G->by_name && G->weight_found && G->bias_found && G->stage && G->host && G->raw;
    for (int k = 0; G->ts && k < 2; k++)  // padding between tensors keeps zero moments: start from zero
        for (int q = 0; q < 2; q++) ok = ok && (G->mom[k][q] = calloc((size_t)(G->ts->regions[k].n + 1), 2)) != NULL;
    if (!ok) {
        snprintf(err, err_size, "%s: out of memory (or HDF5 type setup failed) loading the checkpoint", man->dir);
        return -1;
    }
    for (int i = 0; i < m->n_params; i++) G->by_name[i] = &m->params[i];
    qsort(G->by_name, (size_t)m->n_params, sizeof *G->by_name, compare_param_name);
    for (int f = 0; f < man->n_files; f++) {
        const FileEntry *fe = &man->files[f];
        char fpath[CK_PATH];
        snprintf(fpath, sizeof fpath, "%s/%.*s", man->dir, CK_FILE_NAME_MAX, fe->name);
        struct stat st;
        if (stat(fpath, &st) != 0) {
            if (errno != ENOENT) {
                snprintf(err, err_size, "%s: cannot read it: %s", fpath, strerror(errno));
                return -1;
            }
            if (!n_missing++) missing = fe;  // named below with a tensor it held
            continue;
        }
        if ((int64_t)st.st_size != fe->bytes) {
            snprintf(err, err_size, "%s: %lld bytes, but %s records %lld (truncated, or replaced after the save?)", fpath,
                     (long long)st.st_size, man->path, (long long)fe->bytes);
            return -1;
        }
        if (take_from_file(G, man, fpath, err, err_size) != 0) return -1;
    }
    char what[512];
    const int incomplete = find_missing(G, what, sizeof what);
    if (missing) {
        snprintf(err, err_size, "%s/%s: missing (%s lists it, %lld bytes, written by world rank %d: stage %d, dp %d, "
                 "ep %d)%s%s%s", man->dir, missing->name, CHECKPOINT_MANIFEST, (long long)missing->bytes,
                 missing->world_rank, missing->stage, missing->dp_rank, missing->ep_rank,
                 incomplete ? "; " : ": the checkpoint is incomplete", incomplete ? what : "",
                 incomplete ? ", which this rank needs, is in no other file" : "");
        return -1;
    }
    if (incomplete) {
        snprintf(err, err_size, "%s: %s is in no file of the checkpoint (written for another model?)", man->dir, what);
        return -1;
    }
    return 0;
}

// This rank's part of checkpoint `man` into ts (not collective).
static int load_here(TrainState *ts, const Manifest *man, char *err, size_t err_size) {
    Model *m = &ts->model;
    if (check_same_model(man, ts->cfg, err, err_size) != 0) return -1;
    for (int d = 1; d < man->ints[M_DP]; d++)
        if (man->cursors[d].epoch != man->cursors[0].epoch || man->cursors[d].position != man->cursors[0].position) {
            snprintf(err, err_size, "%s: dataset /loader/train_cursor: dp rank %d's cursor differs from dp rank 0's",
                     man->path, d);
            return -1;
        }
    Gather G = {.ts = ts, .m = m, .bf16 = bf16_type()};
    int rc = -1;
    if (gather_files(&G, man, err, err_size) != 0) goto done;
    char lerr[512];
    if (loader_set_cursor(&ts->train, man->cursors[0], lerr, sizeof lerr) != 0) {
        snprintf(err, err_size, "%s: the training loader's cursor {epoch %llu, position %llu} does not fit this job: %s",
                 man->path, (unsigned long long)man->cursors[0].epoch, (unsigned long long)man->cursors[0].position,
                 lerr);
        goto done;
    }
    for (int k = 0; k < 2; k++) {
        TrainedRegion *r = &ts->regions[k];
        if (r->n == 0) continue;
        device_memcpy_from_host(r->opt.dev, r->opt.m, G.mom[k][0], (size_t)r->n * sizeof(uint16_t));
        device_memcpy_from_host(r->opt.dev, r->opt.v, G.mom[k][1], (size_t)r->n * sizeof(uint16_t));
    }
    model_weights_changed(m);
    ts->step = (int)man->ints[M_STEP];
    rc = 0;
done:
    gather_free(&G);
    return rc;
}

// ---------------------------------------------------------------------------- checkpoint_load

int checkpoint_load(TrainState *ts, const Groups *groups, const char *path, char *err, size_t err_size) {
    const Where w = where_of(groups);
    H5ErrorPrinting saved;
    h5io_quiet(&saved);
    Manifest man;
    int failed = read_manifest(path, &man, err, err_size) != 0;
    if (!failed) {
        failed = load_here(ts, &man, err, err_size) != 0;
        manifest_free(&man);
    }
    h5io_restore(&saved);
    return agree(w.world, failed, err, err_size);
}

int checkpoint_load_model(Model *m, const char *path, int *step, char *err, size_t err_size) {
    H5ErrorPrinting saved;
    h5io_quiet(&saved);
    Manifest man;
    int rc = read_manifest(path, &man, err, err_size);
    if (rc == 0) {
        Gather G = {.m = m, .bf16 = bf16_type()};
        rc = check_same_model(&man, &m->cfg, err, err_size) != 0 || gather_files(&G, &man, err, err_size) != 0 ? -1 : 0;
        gather_free(&G);
        if (rc == 0) {
            model_weights_changed(m);
            if (step) *step = (int)man.ints[M_STEP];
        }
        manifest_free(&man);
    }
    h5io_restore(&saved);
    return rc;
}
