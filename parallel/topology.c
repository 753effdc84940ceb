/*
 * topology.c - the host's RDMA devices through libibverbs and each local GPU's closest one on the PCIe
 * tree, for the start banner (parallel/topology.h).
 *
 * Why libibverbs and sysfs rather than asking MPI or NCCL: both pick their NICs silently; the banner
 * should say what the host has before any of them runs, so a log shows at once a port that is DOWN, an
 * Ethernet (RoCE) port where InfiniBand was expected, or a GPU that shares no PCIe switch with any NIC.
 * Every libibverbs call is checked; a failure becomes a line of the banner (the call, the device, errno's
 * text), never a stop: the job can still run over whatever transport MPI finds.
 */
#include "parallel/topology.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#ifdef FP8MOE_CUDA
#include <cuda_runtime_api.h>
#endif

#define TOPO_MAX_PORTS 64  // ports listed (a device has 1 or 2; a switch-like device more)
#define TOPO_MAX_GPUS 64

// ---------------------------------------------------------------------------- pure helpers

const char *topology_relation_name(TopoRelation r) {
    static const char *const names[] = {"PIX", "PXB", "PHB", "NODE", "SYS"};
    return r >= TOPO_PIX && r <= TOPO_SYS ? names[r] : "?";
}

const char *topology_relation_meaning(TopoRelation r) {
    static const char *const what[] = {"same PCIe switch", "several PCIe switches apart", "same PCIe root complex",
                                       "same NUMA node, different root complexes", "different NUMA nodes"};
    return r >= TOPO_PIX && r <= TOPO_SYS ? what[r] : "unknown";
}

// ibv_port_attr.active_width: 1 = 1x, 2 = 4x, 4 = 8x, 8 = 12x, 16 = 2x lanes (InfiniBand spec encoding)
static int width_lanes(int w) {
    switch (w) {
    case 1: return 1;
    case 2: return 4;
    case 4: return 8;
    case 8: return 12;
    case 16: return 2;
    }
    return 0;
}

const char *topology_width_name(int active_width) {
    switch (width_lanes(active_width)) {
    case 1: return "1x";
    case 2: return "2x";
    case 4: return "4x";
    case 8: return "8x";
    case 12: return "12x";
    }
    return "?";
}

// ibv_port_attr.active_speed: per-lane generation; the nominal per-lane rate as ibstat reports it.
static double lane_gbps(int s) {
    switch (s) {
    case 1: return 2.5;    // SDR
    case 2: return 5.0;    // DDR
    case 4: return 10.0;   // QDR
    case 8: return 10.0;   // FDR10
    case 16: return 14.0;  // FDR
    case 32: return 25.0;  // EDR
    case 64: return 50.0;  // HDR
    case 128: return 100.0;  // NDR
    }
    return 0;
}

const char *topology_speed_name(int active_speed) {
    switch (active_speed) {
    case 1: return "SDR";
    case 2: return "DDR";
    case 4: return "QDR";
    case 8: return "FDR10";
    case 16: return "FDR";
    case 32: return "EDR";
    case 64: return "HDR";
    case 128: return "NDR";
    }
    return "?";
}

double topology_link_gbps(int active_width, int active_speed) {
    return width_lanes(active_width) * lane_gbps(active_speed);
}

// Splits a sysfs path after "/sys/devices/" into its components (in place in buf); returns their count.
static int path_parts(const char *path, char *buf, size_t size, char **parts, int max_parts) {
    const char *p = strstr(path, "/sys/devices/");
    p = p ? p + strlen("/sys/devices/") : path;
    snprintf(buf, size, "%s", p);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, "/", &save); t && n < max_parts; t = strtok_r(NULL, "/", &save))
        parts[n++] = t;
    return n;
}

TopoRelation topology_pci_relation(const char *path_a, int numa_a, const char *path_b, int numa_b) {
    char ba[PATH_MAX], bb[PATH_MAX];
    char *pa[64], *pb[64];
    const int na = path_parts(path_a, ba, sizeof ba, pa, 64), nb = path_parts(path_b, bb, sizeof bb, pb, 64);
    int common = 0;
    while (common < na && common < nb && strcmp(pa[common], pb[common]) == 0) common++;
    if (common == 0 || strncmp(pa[0], "pci", 3) != 0)  // different root complexes (or not on PCI at all)
        return numa_a >= 0 && numa_a == numa_b ? TOPO_NODE : TOPO_SYS;
    if (common == 1) return TOPO_PHB;  // the root complex only
    // the common ancestor is a bridge: one switch (upstream port -> downstream port -> device) is at most
    // two levels from each device
    const int up_a = na - common, up_b = nb - common;
    return up_a <= 2 && up_b <= 2 ? TOPO_PIX : TOPO_PXB;
}

// ---------------------------------------------------------------------------- sysfs

// realpath of /sys/bus/pci/devices/ADDR (or of DIR/device for an RDMA device) into out; 0 or -1.
static int sysfs_real(const char *path, char *out) { return realpath(path, out) ? 0 : -1; }

static int sysfs_numa(const char *dev_path) {
    char p[PATH_MAX + 16];
    snprintf(p, sizeof p, "%s/numa_node", dev_path);
    FILE *f = fopen(p, "r");
    int n = -1;
    if (f) {
        if (fscanf(f, "%d", &n) != 1) n = -1;
        fclose(f);
    }
    return n;
}

// ---------------------------------------------------------------------------- the lines

typedef struct {
    char *buf;
    size_t size, used;
    int lines;
} Out;

static void __attribute__((format(printf, 2, 3))) line(Out *o, const char *fmt, ...) {
    char l[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l, sizeof l, fmt, ap);
    va_end(ap);
    o->lines++;
    if (!o->buf || o->used + 1 >= o->size) return;
    const int n = snprintf(o->buf + o->used, o->size - o->used, "rdma: %s\n", l);
    if (n < 0) return;
    o->used += (size_t)n;
    if (o->used >= o->size) o->used = o->size - 1;  // truncated: the buffer is full (and terminated)
}

typedef struct {
    char name[IBV_SYSFS_NAME_MAX + 1];
    int port;
    int active;
    char pci_path[PATH_MAX];  // "" when unknown
    int numa;
} NicPort;

static const char *link_layer_name(uint8_t ll) {
    switch (ll) {
    case IBV_LINK_LAYER_INFINIBAND: return "InfiniBand";
    case IBV_LINK_LAYER_ETHERNET: return "Ethernet (RoCE)";
    case IBV_LINK_LAYER_UNSPECIFIED: return "InfiniBand (link layer unspecified)";
    }
    return "unknown link layer";
}

static const char *pci_address(const char *path) {  // the last component of a sysfs PCI path
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

// Lists the ports of one device into nics (at most max); returns how many were added.
static int list_device(Out *o, struct ibv_device *dev, NicPort *nics, int max) {
    const char *name = ibv_get_device_name(dev);
    if (!name) {
        line(o, "ibv_get_device_name failed: %s", strerror(errno));
        return 0;
    }
    char pci[PATH_MAX] = "", devdir[PATH_MAX + 16];
    snprintf(devdir, sizeof devdir, "%s/device", dev->ibdev_path);
    if (sysfs_real(devdir, pci) != 0) pci[0] = '\0';
    const int numa = pci[0] ? sysfs_numa(pci) : -1;
    struct ibv_context *ctx = ibv_open_device(dev);
    if (!ctx) {
        line(o, "%s: ibv_open_device failed: %s (errno %d)", name, strerror(errno), errno);
        return 0;
    }
    struct ibv_device_attr attr;
    int rc = ibv_query_device(ctx, &attr);
    int added = 0;
    if (rc != 0) {
        line(o, "%s: ibv_query_device failed: %s (%d)", name, strerror(rc), rc);
    } else {
        for (int p = 1; p <= attr.phys_port_cnt; p++) {
            struct ibv_port_attr pa;
            memset(&pa, 0, sizeof pa);
            rc = ibv_query_port(ctx, (uint8_t)p, &pa);
            if (rc != 0) {
                line(o, "%s port %d: ibv_query_port failed: %s (%d)", name, p, strerror(rc), rc);
                continue;
            }
            char numa_s[32] = "";
            if (numa >= 0) snprintf(numa_s, sizeof numa_s, ", NUMA node %d", numa);
            line(o, "%s port %d: %s, %s, %g Gb/s (%s %s), PCI %s%s", name, p, ibv_port_state_str(pa.state),
                 link_layer_name(pa.link_layer), topology_link_gbps(pa.active_width, pa.active_speed),
                 topology_width_name(pa.active_width), topology_speed_name(pa.active_speed),
                 pci[0] ? pci_address(pci) : "unknown", numa_s);
            if (added < max) {
                NicPort *n = &nics[added++];
                snprintf(n->name, sizeof n->name, "%s", name);
                n->port = p;
                n->active = pa.state == IBV_PORT_ACTIVE;
                snprintf(n->pci_path, sizeof n->pci_path, "%s", pci);
                n->numa = numa;
            }
        }
    }
    if (ibv_close_device(ctx) != 0) line(o, "%s: ibv_close_device failed: %s", name, strerror(errno));
    return added;
}

// The GPUs' sysfs paths (CUDA build: the runtime's PCI bus ids); returns the count, or -1 without CUDA.
static int list_gpus(Out *o, char (*paths)[PATH_MAX], int max) {
#ifdef FP8MOE_CUDA
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        line(o, "no GPU visible to CUDA (cudaGetDeviceCount: %s)", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return 0;
    }
    if (n > max) n = max;
    for (int i = 0; i < n; i++) {
        char bus[32], sys[96];
        e = cudaDeviceGetPCIBusId(bus, (int)sizeof bus, i);
        paths[i][0] = '\0';
        if (e != cudaSuccess) {
            line(o, "gpu %d: cudaDeviceGetPCIBusId failed: %s", i, cudaGetErrorString(e));
            (void)cudaGetLastError();
            continue;
        }
        for (char *c = bus; *c; c++) *c = (char)(*c >= 'A' && *c <= 'F' ? *c - 'A' + 'a' : *c);  // sysfs: lower case
        snprintf(sys, sizeof sys, "/sys/bus/pci/devices/%s", bus);
        if (sysfs_real(sys, paths[i]) != 0) {
            line(o, "gpu %d (PCI %s): not found in sysfs (%s)", i, bus, strerror(errno));
            paths[i][0] = '\0';
        }
    }
    return n;
#else
    (void)o, (void)paths, (void)max;
    return -1;
#endif
}

int topology_format(char *buf, size_t size) {
    Out o = {.buf = buf, .size = size};
    if (buf && size) buf[0] = '\0';
    int n_dev = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&n_dev);
    // NULL with ENOSYS: no kernel RDMA support (no /sys/class/infiniband), the same as no device
    if (!list && errno != ENOSYS && errno != 0) {
        line(&o, "libibverbs could not list the RDMA devices: ibv_get_device_list: %s (errno %d)", strerror(errno),
             errno);
        return o.lines;
    }
    if (!list || n_dev == 0) {
        line(&o, "no RDMA devices (libibverbs found none)");
        if (list) ibv_free_device_list(list);
        return o.lines;
    }
    char host[256] = "?";
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "? (gethostname: %s)", strerror(errno));
    host[sizeof host - 1] = '\0';
    line(&o, "host %s: %d RDMA device%s", host, n_dev, n_dev == 1 ? "" : "s");
    NicPort *nics = calloc(TOPO_MAX_PORTS, sizeof *nics);
    char (*gpus)[PATH_MAX] = calloc(TOPO_MAX_GPUS, sizeof *gpus);
    if (!nics || !gpus) {
        line(&o, "out of host memory for the device list");
        free(nics), free(gpus);
        ibv_free_device_list(list);
        return o.lines;
    }
    int n_nics = 0;
    for (int d = 0; d < n_dev; d++) n_nics += list_device(&o, list[d], nics + n_nics, TOPO_MAX_PORTS - n_nics);
    ibv_free_device_list(list);

    const int n_gpus = list_gpus(&o, gpus, TOPO_MAX_GPUS);
    if (n_gpus < 0) line(&o, "no GPU (this build has no CUDA)");
    else if (n_gpus == 0) line(&o, "no GPU visible to CUDA");
    for (int g = 0; g < n_gpus; g++) {
        if (!gpus[g][0]) continue;  // its failure is already a line
        const int gnuma = sysfs_numa(gpus[g]);
        int best = -1;
        TopoRelation best_r = TOPO_SYS;
        for (int i = 0; i < n_nics; i++) {  // the closest port; among equals an ACTIVE one, then the first
            if (!nics[i].pci_path[0]) continue;
            const TopoRelation r = topology_pci_relation(gpus[g], gnuma, nics[i].pci_path, nics[i].numa);
            if (best < 0 || r < best_r || (r == best_r && nics[i].active && !nics[best].active)) best = i, best_r = r;
        }
        if (best < 0)
            line(&o, "gpu %d (PCI %s): no RDMA device with a known PCI address", g, pci_address(gpus[g]));
        else
            line(&o, "gpu %d (PCI %s) -> %s port %d (%s: %s)%s", g, pci_address(gpus[g]), nics[best].name,
                 nics[best].port, topology_relation_name(best_r), topology_relation_meaning(best_r),
                 nics[best].active ? "" : ", port not ACTIVE");
    }
    free(nics);
    free(gpus);
    return o.lines;
}

void topology_print(FILE *f) {
    char buf[16384];
    topology_format(buf, sizeof buf);
    fputs(buf, f);
    fflush(f);
}
