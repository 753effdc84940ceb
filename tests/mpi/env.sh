# env.sh - sourced by the MPI test scripts: the mpirun command line they share and its environment.
#   --oversubscribe, --bind-to none   up to 8 ranks on CI's 2 cores, free to move between them
#   mpi_yield_when_idle 1             Open MPI's own waits yield the core (comm.c's waits sleep ~50 us)
# Open MPI refuses to run as root unless told; CI runs as root in a throwaway machine.
# Under the sanitizers (FP8MOE_SANITIZE=1) LeakSanitizer reads tests/mpi/lsan.supp: Open MPI keeps what
# MPI_Init allocates until exit, which LSan would report as leaks of every test; the suppressions name only
# Open MPI's libraries, so a leak in fp8moe's own code still fails the test. fast_unwind_on_malloc=0: Open
# MPI is built without frame pointers and unloads the components it does not select, so the fast unwinder
# stops at the first frame (often in an unloaded component, "<unknown module>") and no suppression could
# match; the slow unwinder reaches the libopen-pal / libmpi frames below it.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
MPIRUN=(mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
if [ "${FP8MOE_SANITIZE:-0}" = 1 ]; then
  export LSAN_OPTIONS="suppressions=$(pwd)/tests/mpi/lsan.supp:print_suppressions=0"
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0"
  MPIRUN+=(-x LSAN_OPTIONS -x ASAN_OPTIONS)
fi
