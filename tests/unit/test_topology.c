/*
 * test_topology.c - unit tests of the RDMA / PCIe banner (parallel/topology.c): the PCIe relation of a GPU
 * and a NIC on hand-made sysfs paths (one switch, several switches, the root complex only, two root
 * complexes on one or two NUMA nodes), the link speed of the InfiniBand width and speed codes, and the
 * banner itself on this machine: it runs, every line starts with "rdma: ", and on a host without RDMA
 * devices (no /sys/class/infiniband, as on CI) it is exactly the no-device line. A buffer too small still
 * comes back terminated.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <dirent.h>

#include <cmocka.h>

#include "parallel/topology.h"

#define ROOT "/sys/devices/pci0000:16"
#define SWITCH ROOT "/0000:16:02.0/0000:17:00.0"  // root port, then a switch's upstream port

static void test_relation(void **state) {
    (void)state;
    // GPU and NIC behind two downstream ports of one switch
    const char *gpu = SWITCH "/0000:18:00.0/0000:19:00.0", *nic = SWITCH "/0000:18:01.0/0000:1a:00.0";
    assert_int_equal(topology_pci_relation(gpu, 0, nic, 0), TOPO_PIX);
    assert_int_equal(topology_pci_relation(nic, 0, gpu, 0), TOPO_PIX);
    // the same, with a second switch level above the GPU
    const char *deep = SWITCH "/0000:18:00.0/0000:19:00.0/0000:1a:08.0/0000:1b:00.0";
    assert_int_equal(topology_pci_relation(deep, 0, nic, 0), TOPO_PXB);
    // only the root complex in common
    const char *other_port = ROOT "/0000:16:03.0/0000:30:00.0";
    assert_int_equal(topology_pci_relation(gpu, 0, other_port, 0), TOPO_PHB);
    // two root complexes: same NUMA node, different ones, unknown
    const char *other_root = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0";
    assert_int_equal(topology_pci_relation(gpu, 0, other_root, 0), TOPO_NODE);
    assert_int_equal(topology_pci_relation(gpu, 0, other_root, 1), TOPO_SYS);
    assert_int_equal(topology_pci_relation(gpu, -1, other_root, -1), TOPO_SYS);
    // a device that is not under a PCI root (a virtual device) is never close
    assert_int_equal(topology_pci_relation("/sys/devices/virtual/net/lo", -1, nic, 0), TOPO_SYS);
    assert_string_equal(topology_relation_name(TOPO_PIX), "PIX");
    assert_string_equal(topology_relation_name(TOPO_SYS), "SYS");
    assert_string_equal(topology_relation_meaning(TOPO_PHB), "same PCIe root complex");
}

static void test_link_speed(void **state) {
    (void)state;
    assert_true(topology_link_gbps(2, 128) == 400.0);  // 4x NDR
    assert_true(topology_link_gbps(2, 64) == 200.0);   // 4x HDR
    assert_true(topology_link_gbps(2, 32) == 100.0);   // 4x EDR
    assert_true(topology_link_gbps(1, 1) == 2.5);      // 1x SDR
    assert_true(topology_link_gbps(8, 16) == 168.0);   // 12x FDR
    assert_true(topology_link_gbps(0, 32) == 0.0);     // unknown width
    assert_true(topology_link_gbps(2, 3) == 0.0);      // unknown speed
    assert_string_equal(topology_width_name(2), "4x");
    assert_string_equal(topology_width_name(16), "2x");
    assert_string_equal(topology_speed_name(128), "NDR");
    assert_string_equal(topology_speed_name(0), "?");
}

// Whether /sys/class/infiniband lists a device (what libibverbs would find).
static int host_has_rdma(void) {
    DIR *d = opendir("/sys/class/infiniband");
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n > 0;
}

static void test_banner(void **state) {
    (void)state;
    char buf[16384];
    const int lines = topology_format(buf, sizeof buf);
    printf("%s", buf);  // what the banner would print here
    assert_true(lines >= 1);
    int counted = 0;
    for (const char *p = buf; *p; counted++) {
        assert_memory_equal(p, "rdma: ", 6);
        const char *nl = strchr(p, '\n');
        assert_non_null(nl);
        p = nl + 1;
    }
    assert_int_equal(counted, lines);
    if (!host_has_rdma()) {
        assert_string_equal(buf, "rdma: no RDMA devices (libibverbs found none)\n");
    } else {
        assert_non_null(strstr(buf, " RDMA device"));
        assert_non_null(strstr(buf, " port 1: "));
    }
    char small[12];
    memset(small, 'x', sizeof small);
    assert_int_equal(topology_format(small, sizeof small), lines);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_memory_equal(small, buf, sizeof small - 1);
    assert_int_equal(topology_format(NULL, 0), lines);  // counts without a buffer
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_relation),
        cmocka_unit_test(test_link_speed),
        cmocka_unit_test(test_banner),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
