# uniprefill build. `make` builds the library, the upf CLI, the CUnit tests and the benchmarks.
# CUDA=1 (the default whenever nvcc is on PATH) adds the CUDA backend built with nvcc for sm_90a;
# CUDA=0 builds a CPU-only tree. Sources are discovered by directory, so adding an op adds files,
# not Makefile lines.

NVCC ?= $(shell command -v nvcc 2>/dev/null)
ifeq ($(NVCC),)
CUDA ?= 0
else
CUDA ?= 1
endif

CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a
# A CPU-only tree builds apart, so switching CUDA= never mixes objects of the two.
BUILD ?= build$(if $(filter 0,$(CUDA)),-cpu)

CC ?= cc
CXX ?= c++
OPT ?= -O2
WARN = -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers
CPPFLAGS += -Iinclude -I. -I/usr/include/x86_64-linux-gnu/openblas-pthread -MMD -MP
CFLAGS += -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE $(OPT) -g -ffp-contract=off $(WARN)
CXXFLAGS += -std=c++17 $(OPT) -g -ffp-contract=off $(WARN)
NVCCFLAGS += -std=c++17 $(OPT) $(CUDA_ARCH) -Iinclude -I. -lineinfo -Xcompiler -Wall \
	-Xcudafe --diag_suppress=177 --expt-relaxed-constexpr
LDLIBS += -lopenblas -lm -lpthread

ifeq ($(CUDA),1)
CPPFLAGS += -DUPF_HAVE_CUDA=1 -I$(CUDA_HOME)/include
LDLIBS += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart_static -ldl -lrt -lstdc++
CUDA_SRC := $(wildcard cuda/*.cu)
else
CUDA_SRC :=
endif

LIB_C_SRC := $(wildcard core/*.c ref_cpu/*.c layers/*.c models/*.c verify/*.c)
LIB_CXX_SRC := $(wildcard perf/*.cc)
LIB_PERF_C_SRC := $(filter-out perf/bench_main.c,$(wildcard perf/*.c))
CLI_SRC := $(wildcard cli/*.c)
TEST_SRC := $(wildcard tests/*.c)

LIB_OBJ := $(LIB_C_SRC:%.c=$(BUILD)/%.o) $(CUDA_SRC:%.cu=$(BUILD)/%.cu.o)
PERF_OBJ := $(LIB_PERF_C_SRC:%.c=$(BUILD)/%.o) $(LIB_CXX_SRC:%.cc=$(BUILD)/%.o)
LIB := $(BUILD)/libuniprefill.a

UPF := $(BUILD)/upf
TEST_BIN := $(BUILD)/test_upf
BENCH_BIN := $(BUILD)/bench_upf

.PHONY: all deps models run test test-unit test-memcheck verify bench clean

all: $(LIB) $(UPF) $(TEST_BIN) $(BENCH_BIN)

deps:
	bash ci/install-deps.sh

# The real GGUF models and the gguf-py venv, cached outside git; offline the script says why and
# exits 0, and the tests that need the files skip by name, so this never fails the build.
models:
	bash ci/fetch-models.sh || echo "make: ci/fetch-models.sh failed (above); the tests that need the models skip"

# Every object depends on the compile commands: a change of flags (an architecture, OPT=) rebuilds
# them all instead of linking objects of two configurations.
FLAGS_STAMP := $(BUILD)/.compile-flags
COMPILE_FLAGS := $(CC) $(CPPFLAGS) $(CFLAGS) | $(CXX) $(CXXFLAGS) | $(NVCC) $(NVCCFLAGS)
$(FLAGS_STAMP): FORCE
	@mkdir -p $(dir $@)
	@echo '$(COMPILE_FLAGS)' | cmp -s - $@ || echo '$(COMPILE_FLAGS)' >$@

.PHONY: FORCE
FORCE:

$(BUILD)/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/%.o: %.cc $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c $< -o $@

$(BUILD)/%.cu.o: %.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -DUPF_HAVE_CUDA=1 -MMD -MP -c $< -o $@

$(LIB): $(LIB_OBJ) $(PERF_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(UPF): $(CLI_SRC:%.c=$(BUILD)/%.o) $(LIB)
	$(CXX) -o $@ $^ $(LDLIBS) -lbenchmark

$(TEST_BIN): $(TEST_SRC:%.c=$(BUILD)/%.o) $(LIB)
	$(CXX) -o $@ $^ $(LDLIBS) -lcunit -lbenchmark

$(BENCH_BIN): $(BUILD)/perf/bench_main.o $(LIB)
	$(CXX) -o $@ $^ $(LDLIBS) -lbenchmark

# The main job: verify what this machine's backends can run, benchmark, and summarise.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

run: deps
	$(MAKE) -j$(JOBS) all
	$(UPF) report --out $(BUILD)/report

# The CPU-only build of the suites under Valgrind memcheck first (the CUDA libraries' own load-time
# code, libcublasLt's constructors, is not ours to check and trips Valgrind in ld.so), then every
# suite of the full build, so the output ends with CUnit's run summary.
test: deps models
	$(MAKE) -j$(JOBS) all
	$(MAKE) -j$(JOBS) CUDA=0 BUILD=$(BUILD)-memcheck all
	@echo "make test: the CPU-only suites under Valgrind memcheck (quick set; silent for several minutes) ..."
	UPF_TEST_QUICK=1 valgrind --error-exitcode=3 --leak-check=full \
	  --errors-for-leak-kinds=definite --show-leak-kinds=definite $(BUILD)-memcheck/test_upf
	$(TEST_BIN)

verify: all
	$(UPF) verify all

bench: all
	$(BENCH_BIN) --benchmark_out=$(BUILD)/bench.json --benchmark_out_format=json

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
