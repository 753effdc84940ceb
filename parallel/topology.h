/*
 * topology.h - what the host offers the communication layer: its RDMA devices (libibverbs: name, port
 * state, link layer, speed, PCI address) and, for every local GPU, the RDMA device it is closest to on the
 * PCIe tree (issue 19 item 7, DESIGN.md section 1 "topology (incl. libibverbs NIC discovery)").
 *
 * It is printed in the start banner (world rank 0, after groups_print_banner) so that a job's log says
 * which NICs its ranks could use and whether a GPU shares a PCIe switch with one, the first thing to check
 * when inter-node all-to-all bandwidth is low. Nothing here picks a NIC yet: NCCL and Open MPI choose
 * their own; this is the information a later NIC-per-GPU binding will use.
 *
 * Lines, each starting with "rdma: ":
 *   rdma: host vm: 2 RDMA devices
 *   rdma: mlx5_0 port 1: ACTIVE, InfiniBand, 400 Gb/s (4x NDR), PCI 0000:3b:00.0, NUMA node 0
 *   rdma: gpu 0 (PCI 0000:18:00.0) -> mlx5_0 port 1 (PIX: same PCIe switch)
 *   rdma: no RDMA devices (libibverbs found none)         (no device, or no kernel RDMA support)
 * A libibverbs call that fails gives a line naming the call, the device and errno's text instead of its
 * facts; the banner never stops the job. GPUs come from the CUDA runtime (cudaDeviceGetPCIBusId) in a CUDA
 * build; without CUDA the GPU line says "no GPU (this build has no CUDA)".
 *
 * PCIe relation of a GPU and a NIC, from their sysfs paths (realpath of /sys/bus/pci/devices/ADDR), with
 * nvidia-smi topo's names, best first:
 *   PIX   both within one PCIe switch (their common ancestor is a bridge at most two levels above each)
 *   PXB   a common bridge further up (several switches between them), not the host bridge
 *   PHB   only the PCIe root complex (host bridge) in common
 *   NODE  different root complexes on the same NUMA node
 *   SYS   different NUMA nodes (or a NUMA node unknown)
 */
#ifndef FP8MOE_TOPOLOGY_H
#define FP8MOE_TOPOLOGY_H

#include <stddef.h>
#include <stdio.h>

typedef enum { TOPO_PIX = 0, TOPO_PXB = 1, TOPO_PHB = 2, TOPO_NODE = 3, TOPO_SYS = 4 } TopoRelation;

// The lines above for this host, each ending in '\n', into buf (truncated, still terminated, when size is too
// small). Returns the number of lines. Opens every RDMA device briefly (ibv_open_device); no communication.
int topology_format(char *buf, size_t size);
// topology_format to f.
void topology_print(FILE *f);

// Pure helpers (unit-tested without devices):
// The relation of two PCI devices given their sysfs paths (e.g. /sys/devices/pci0000:17/0000:17:00.0/
// 0000:18:00.0) and NUMA nodes (-1 = unknown).
TopoRelation topology_pci_relation(const char *path_a, int numa_a, const char *path_b, int numa_b);
const char *topology_relation_name(TopoRelation r);     // "PIX", ...
const char *topology_relation_meaning(TopoRelation r);  // "same PCIe switch", ...
// Link speed in Gb/s of an ibv_port_attr's active_width and active_speed codes (0 when unknown), and the
// lane width and generation names ("4x", "NDR"; "?" when unknown).
double topology_link_gbps(int active_width, int active_speed);
const char *topology_width_name(int active_width);
const char *topology_speed_name(int active_speed);

#endif
