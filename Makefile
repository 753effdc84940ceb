# fp8moe build. One entry point for everything:
#   make            all binaries into $(BUILD)/ (CPU always; CUDA when nvcc >= 12.9 is found)
#   make test       CPU unit tests (CMocka), gradient check, MPI tests, then the same under ASan+UBSan
#   make test-mpi   the MPI tests (tests/mpi: collectives, groups, timeouts) under mpirun on 1-8 ranks
#   make test-mpi-large  EP64: 64 CPU ranks (dp = ep = 64) against one process (not part of make test)
#   make run        set up data and train the default job (configs/shakespeare.ini)
#   make deps       install missing Debian/Ubuntu packages (as root) or say what is missing
#   make test-gpu   build and run the GPU parity tests (needs an NVIDIA GPU)
# Sources are found by wildcard so that a new file in a module directory needs no Makefile edit.
# BUILD=dir puts every output under another directory (parallel builds, sanitizer builds).
# OPT sets the optimisation level; EXTRA_CFLAGS / EXTRA_LDLIBS add include and library paths.

BUILD    ?= build
CC       ?= gcc
# nvcc from PATH, else the CUDA toolkit's usual home
NVCC     ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc),nvcc)
SANITIZE ?= 0

PKGS     := inih hdf5-serial
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)

# MPI (Open MPI, DESIGN.md section 8): every build links it; without mpirun the binary starts MPI as a
# singleton and runs as one process. Flags from pkg-config, else from the mpicc wrapper.
MPI_CFLAGS := $(shell pkg-config --cflags ompi-c 2>/dev/null || mpicc --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell pkg-config --libs ompi-c 2>/dev/null || mpicc --showme:link 2>/dev/null)
ifeq ($(strip $(MPI_LIBS)),)
ifneq ($(filter-out deps clean cuda-status,$(or $(MAKECMDGOALS),all)),)
$(error fp8moe: Open MPI not found: neither `pkg-config ompi-c` nor `mpicc --showme:link` answered; install libopenmpi-dev and openmpi-bin (make deps, or bash scripts/deps.sh))
endif
endif

# libibverbs (DESIGN.md section 8): the start banner lists the host's RDMA devices and which one each GPU is
# closest to (parallel/topology.c). Flags from pkg-config, else the plain library when its header is there.
IBV_CFLAGS := $(shell pkg-config --cflags libibverbs 2>/dev/null)
IBV_LIBS   := $(shell pkg-config --libs libibverbs 2>/dev/null || { [ -f /usr/include/infiniband/verbs.h ] && echo -libverbs; })
ifeq ($(strip $(IBV_LIBS)),)
ifneq ($(filter-out deps clean cuda-status,$(or $(MAKECMDGOALS),all)),)
$(error fp8moe: libibverbs not found: neither `pkg-config libibverbs` nor /usr/include/infiniband/verbs.h answered; install libibverbs-dev (make deps, or bash scripts/deps.sh))
endif
endif

# -ffp-contract=off: the CPU path is the numerical reference (DESIGN.md section 4); no FMA contraction.
OPT      ?= -O2
CFLAGS   := $(OPT) $(EXTRA_CFLAGS) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -ffp-contract=off -fopenmp -g -I. $(PKG_CFLAGS) $(MPI_CFLAGS) $(IBV_CFLAGS)
LDLIBS   := $(EXTRA_LDLIBS) $(PKG_LIBS) $(MPI_LIBS) $(IBV_LIBS) -lm -fopenmp
ifeq ($(SANITIZE),1)
CFLAGS   += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
LDLIBS   += -fsanitize=address,undefined
endif

# ---------------------------------------------------------------------------- CUDA detection
# CUDA >= 12.9 is needed for cuBLASLt's block-scaled FP8 (later issues); older toolkits build CPU-only.
NVCC_VERSION := $(shell $(NVCC) --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
CUDA_OK := $(shell v="$(NVCC_VERSION)"; set -- $$v; [ -n "$$1" ] && [ $$1 -gt 12 -o \( $$1 -eq 12 -a $$2 -ge 9 \) ] && echo 1)
ifeq ($(NO_CUDA),1)
CUDA_OK :=
endif
ifeq ($(CUDA_OK),1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell which $(NVCC)))
NVCCFLAGS ?= -O2 -arch=sm_90 -std=c++17 -I. -DFP8MOE_CUDA -Xcompiler -Wall,-Wextra,-Werror
NVCCFLAGS += $(MPI_CFLAGS)
CFLAGS   += -DFP8MOE_CUDA -I$(CUDA_HOME)/include
LDLIBS   += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublasLt -lstdc++
CUDA_SRC := $(wildcard kernels/cuda/*.cu)
CUDA_WHY := CUDA $(subst $() ,.,$(NVCC_VERSION)) found: building kernels/cuda
else
CUDA_SRC :=
CUDA_WHY := building CPU-only: $(if $(NO_CUDA),NO_CUDA=1 was given,$(if $(NVCC_VERSION),nvcc $(subst $() ,.,$(NVCC_VERSION)) is older than 12.9,no nvcc on PATH))
endif

# ---------------------------------------------------------------------------- NCCL detection (CUDA builds)
# The NCCL backend of parallel/comm.h (parallel/comm_nccl.c, -DFP8MOE_NCCL) is built when a CUDA build finds nccl.h
# and libnccl: in NCCL_HOME, else the CUDA toolkit, else /usr (Debian/Ubuntu's libnccl-dev), else python3's
# nvidia.nccl (the NCCL wheel of PyTorch images). NO_NCCL=1 leaves it out. A build without it says so when NCCL is
# asked for (comm_nccl_dup; comm_nccl_available() is 0). Multi-GPU NCCL jobs run with NCCL_NVLS_ENABLE=0.
NCCL_LIBS :=
ifeq ($(CUDA_OK),1)
ifeq ($(NO_NCCL),1)
NCCL_WHY := no NCCL: NO_NCCL=1 was given; the NCCL backend is not in this build
else
NCCL_PY     := $(shell python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
NCCL_ROOT   := $(firstword $(foreach d,$(NCCL_HOME) $(CUDA_HOME) /usr $(NCCL_PY),$(if $(wildcard $(d)/include/nccl.h),$(d))))
NCCL_ARCH   := $(shell $(CC) -print-multiarch 2>/dev/null)
NCCL_LIBDIR := $(if $(NCCL_ROOT),$(firstword $(foreach l,lib64 lib $(if $(NCCL_ARCH),lib/$(NCCL_ARCH)),$(if $(wildcard $(NCCL_ROOT)/$(l)/libnccl.so*),$(NCCL_ROOT)/$(l)))))
ifneq ($(NCCL_LIBDIR),)
NCCL_VERSION := $(shell sed -n 's/^\#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' $(NCCL_ROOT)/include/nccl.h | paste -sd.)
NCCL_LIBS := $(if $(filter /usr/% $(CUDA_HOME)/lib64,$(NCCL_LIBDIR)),,-L$(NCCL_LIBDIR) -Wl,-rpath,$(NCCL_LIBDIR)) $(if $(wildcard $(NCCL_LIBDIR)/libnccl.so),-lnccl,-l:libnccl.so.2)
CFLAGS   += -DFP8MOE_NCCL $(if $(filter /usr $(CUDA_HOME),$(NCCL_ROOT)),,-I$(NCCL_ROOT)/include)
LDLIBS   += $(NCCL_LIBS)
NCCL_WHY := NCCL $(NCCL_VERSION) found in $(NCCL_ROOT) ($(NCCL_LIBDIR)): building the NCCL backend
else
NCCL_WHY := no NCCL: nccl.h and libnccl not found in NCCL_HOME, $(CUDA_HOME), /usr or python3's nvidia.nccl; the NCCL backend is not in this build
endif
endif
else
NCCL_WHY := no NCCL: not a CUDA build; the NCCL backend is not in this build
endif

# ---------------------------------------------------------------------------- sources
LIB_SRC  := $(wildcard kernels/*.c kernels/cpu/*.c train/*.c optim/*.c data/*.c parallel/*.c)
LIB_SRC  := $(filter-out train/main.c,$(LIB_SRC))
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o) $(CUDA_SRC:%.cu=$(BUILD)/obj/%.cu.o)
# The same sources with real = double, for the gradient check (no CUDA in this build).
DBL_SRC  := $(LIB_SRC)
DBL_OBJ  := $(DBL_SRC:%.c=$(BUILD)/dobj/%.o)

UNIT_SRC := $(filter-out tests/unit/test_gradcheck.c,$(wildcard tests/unit/test_*.c))
UNIT_BIN := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)
BENCH_SRC := $(wildcard tests/bench/bench_*.c)
BENCH_BIN := $(BENCH_SRC:tests/bench/%.c=$(BUILD)/bench/%)
MPI_TEST_SRC := $(wildcard tests/mpi/*.c)
MPI_TEST_BIN := $(MPI_TEST_SRC:tests/mpi/%.c=$(BUILD)/mpi/%)
GPU_SRC  := $(wildcard tests/gpu/test_*.c)
GPU_BIN  := $(if $(CUDA_OK),$(GPU_SRC:tests/gpu/%.c=$(BUILD)/tests/%))

.PHONY: all test test-unit test-mpi test-mpi-large test-asan run deps test-gpu bench clean cuda-status
all: cuda-status $(BUILD)/fp8moe $(BUILD)/gradcheck $(BUILD)/gradcheck_f32 $(UNIT_BIN) $(MPI_TEST_BIN) $(GPU_BIN) $(BENCH_BIN)

cuda-status:
	@echo "fp8moe: $(CUDA_WHY)"
	@echo "fp8moe: $(NCCL_WHY)"

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@
$(BUILD)/dobj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -DFP8MOE_CUDA,$(CFLAGS)) -DFP8MOE_REAL_DOUBLE -MMD -MP -c $< -o $@
$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@
# wgmma needs the sm_90a target (docs/gpu.md): the Hopper attention kernels and the grouped FP8 GEMM
$(BUILD)/obj/kernels/cuda/attention_wgmma.cu.o: NVCCFLAGS := $(filter-out -arch=sm_90,$(NVCCFLAGS)) -gencode=arch=compute_90a,code=sm_90a
$(BUILD)/obj/kernels/cuda/fp8_grouped_gemm.cu.o: NVCCFLAGS := $(filter-out -arch=sm_90,$(NVCCFLAGS)) -gencode=arch=compute_90a,code=sm_90a

$(BUILD)/libfp8moe.a: $(LIB_OBJ)
	@rm -f $@; ar rcs $@ $^
$(BUILD)/libfp8moe_double.a: $(DBL_OBJ)
	@rm -f $@; ar rcs $@ $^

$(BUILD)/fp8moe: $(BUILD)/obj/train/main.o $(BUILD)/libfp8moe.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/tests/%: tests/unit/%.c $(BUILD)/libfp8moe.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests $< $(BUILD)/libfp8moe.a -o $@ $(LDLIBS) -lcmocka
$(BUILD)/mpi/%: tests/mpi/%.c $(BUILD)/libfp8moe.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests $< $(BUILD)/libfp8moe.a -o $@ $(LDLIBS)
$(BUILD)/bench/%: tests/bench/%.c $(BUILD)/libfp8moe.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< $(BUILD)/libfp8moe.a -o $@ $(LDLIBS)
$(BUILD)/tests/test_gpu_%: tests/gpu/test_gpu_%.c $(BUILD)/libfp8moe.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests $< $(BUILD)/libfp8moe.a -o $@ $(LDLIBS) -lcmocka
$(BUILD)/gradcheck: tests/unit/test_gradcheck.c $(BUILD)/libfp8moe_double.a
	$(CC) $(filter-out -DFP8MOE_CUDA,$(CFLAGS)) -DFP8MOE_REAL_DOUBLE -Itests $< $(BUILD)/libfp8moe_double.a -o $@ $(filter-out -lcudart -lcublasLt -lstdc++ $(NCCL_LIBS),$(LDLIBS)) -lcmocka
$(BUILD)/gradcheck_f32: tests/unit/test_gradcheck.c $(BUILD)/libfp8moe.a
	$(CC) $(CFLAGS) -Itests $< $(BUILD)/libfp8moe.a -o $@ $(LDLIBS) -lcmocka

# One after the other: the MPI tests time their ranks and must not share the cores with the unit tests.
test: test-unit
	@$(MAKE) --no-print-directory test-mpi
	@$(MAKE) --no-print-directory test-asan
test-unit: all
	@BUILD=$(BUILD) FP8MOE_SANITIZE=$(SANITIZE) bash tests/run_unit.sh
test-mpi: $(MPI_TEST_BIN) $(BUILD)/fp8moe
	@BUILD=$(BUILD) FP8MOE_SANITIZE=$(SANITIZE) bash tests/mpi/run.sh
test-mpi-large: $(BUILD)/mpi/test_parallel_equivalence
	@BUILD=$(BUILD) FP8MOE_SANITIZE=$(SANITIZE) bash tests/mpi/run_large.sh
test-asan:
	@$(MAKE) --no-print-directory BUILD=$(BUILD)/asan SANITIZE=1 NO_CUDA=1 OPT=-O1 test-unit
	@$(MAKE) --no-print-directory BUILD=$(BUILD)/asan SANITIZE=1 NO_CUDA=1 OPT=-O1 test-mpi

test-gpu:
	bash tests/gpu/run.sh

run: all
	bash scripts/deps.sh --check
	$(BUILD)/fp8moe train configs/shakespeare.ini

deps:
	bash scripts/deps.sh

bench: all
	BUILD=$(BUILD) bash tests/bench/run.sh

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj $(BUILD)/dobj -name '*.d' 2>/dev/null)
