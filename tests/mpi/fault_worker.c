/*
 * fault_worker.c - a job that goes wrong on purpose, for tests/mpi/faults.sh, which checks that the whole
 * job ends non-zero, soon, with a message naming the rank, the operation and the group.
 *
 *   fault_worker MODE [TIMEOUT_S]
 *   sleep     the last rank sleeps 60 s; the others wait in comm_barrier on group "dp" and time out
 *   stop      the last rank stops itself (SIGSTOP); the others time out in comm_allreduce_sum_double on "dp"
 *   kill      the last rank kills itself (SIGKILL) before an all-reduce; mpirun ends the job
 *   mismatch  rank 0 sends 8 bytes, rank 1 expects 16: "received 8 bytes from rank 0, expected 16"
 *   truncate  rank 0 sends 8 bytes, rank 1 expects 4: MPI's truncation error, reported with its string
 * Exit status 0 only if the fault did not end the job (a test failure).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "parallel/comm.h"

int main(int argc, char **argv) {
    comm_init(&argc, &argv);
    if (argc < 2) {
        fprintf(stderr, "usage: fault_worker sleep|stop|kill|mismatch|truncate [TIMEOUT_S]\n");
        comm_finalize();
        return 2;
    }
    const char *mode = argv[1];
    comm_set_timeout(argc > 2 ? atof(argv[2]) : 2.0);
    Comm *world = comm_world();
    const int last = world->rank == world->size - 1;
    Comm *dp = comm_split(world, 0, world->rank, "dp");
    double x = 1;
    if (strcmp(mode, "sleep") == 0) {
        if (last) sleep(60);
        comm_barrier(dp);
    } else if (strcmp(mode, "stop") == 0) {
        if (last) raise(SIGSTOP);
        comm_allreduce_sum_double(dp, &x, 1);
    } else if (strcmp(mode, "kill") == 0) {
        if (last) raise(SIGKILL);
        comm_allreduce_sum_double(dp, &x, 1);
    } else if (strcmp(mode, "mismatch") == 0 || strcmp(mode, "truncate") == 0) {
        char buf[16] = {0};
        if (dp->rank == 0) comm_send_bytes(dp, buf, 8, 1, 5);
        if (dp->rank == 1) comm_recv_bytes(dp, buf, strcmp(mode, "mismatch") == 0 ? 16 : 4, 0, 5);
        comm_barrier(dp);
    } else {
        fprintf(stderr, "fault_worker: unknown mode '%s'\n", mode);
        return 2;
    }
    printf("fault_worker %s: rank %d: the fault did not end the job\n", mode, world->rank);
    comm_free(dp);
    comm_finalize();
    return 0;
}
