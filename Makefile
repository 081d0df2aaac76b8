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
# Sanitizer and coverage flags for every compile (empty by default; `make fuzz` sets them).
SAN ?=
CFLAGS += $(SAN)
CXXFLAGS += $(SAN)

ifeq ($(CUDA),1)
CPPFLAGS += -DUPF_HAVE_CUDA=1 -I$(CUDA_HOME)/include
LDLIBS += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcublasLt -lcudart_static -ldl -lrt -lstdc++
CUDA_SRC := $(wildcard cuda/*.cu)
else
CUDA_SRC :=
endif

# Tensor parallelism's communicator (include/uniprefill/comm.h). No binary links MPI or NCCL, so every
# one starts on a machine without them: the MPI backend is the plugin $(BUILD)/libupf_mpi.so (built
# when mpicc, OpenMPI from ci/install-deps.sh, is found; linked with libmpi; core/comm.c opens it next
# to the executable or at UPF_MPI_PLUGIN), the NCCL backend is built when CUDA=1 and nccl.h is found
# under NCCL_HOME (default: the CUDA toolkit, /usr, or the pip package nvidia-nccl-cu*) and opens
# libnccl at run time (UPF_NCCL_LIB, the loader's path, then the library found here). Without them,
# the communicator reports "built without MPI" / "built without NCCL". Only the communicator's objects
# see these flags (their own stamp), so the rest of the tree does not rebuild when MPI or NCCL appears.
MPI ?= 1
ifeq ($(MPI),1)
MPI_CFLAGS := $(shell mpicc --showme:compile 2>/dev/null || pkg-config --cflags ompi-c 2>/dev/null)
MPI_LIBS := $(shell mpicc --showme:link 2>/dev/null || pkg-config --libs ompi-c 2>/dev/null)
endif
MPI_PLUGIN := $(if $(MPI_LIBS),$(BUILD)/libupf_mpi.so)
TP_CHECK := $(if $(MPI_LIBS),$(BUILD)/tp_check)
COMM_CPPFLAGS := $(if $(MPI_LIBS),-DUPF_HAVE_MPI=1 -DUPF_MPI_PLUGIN_PATH='"$(abspath $(BUILD))/libupf_mpi.so"')
ifeq ($(CUDA),1)
NCCL_HOME ?= $(firstword $(foreach d,$(CUDA_HOME) /usr $(shell python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' \
	2>/dev/null),$(if $(wildcard $(d)/include/nccl.h),$(d))))
NCCL_LIB := $(if $(NCCL_HOME),$(firstword $(wildcard $(NCCL_HOME)/lib64/libnccl.so.2 $(NCCL_HOME)/lib/libnccl.so.2 \
	$(NCCL_HOME)/lib/x86_64-linux-gnu/libnccl.so.2)))
ifneq ($(NCCL_HOME),)
COMM_CPPFLAGS += -DUPF_HAVE_NCCL=1
COMM_NVCCFLAGS := -DUPF_HAVE_NCCL=1 -I$(NCCL_HOME)/include $(if $(NCCL_LIB),-DUPF_NCCL_LIB_PATH='"$(NCCL_LIB)"')
endif
endif
COMM_OBJ := $(BUILD)/core/comm.o $(if $(filter 1,$(CUDA)),$(BUILD)/cuda/comm_nccl.cu.o)
COMM_STAMP := $(BUILD)/.comm-flags
# the MPI plugin resolves the library's functions in the executable that opens it
LDLIBS += -ldl -rdynamic

LIB_C_SRC := $(filter-out core/comm_mpi.c,$(wildcard core/*.c ref_cpu/*.c layers/*.c models/*.c verify/*.c))
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

.PHONY: all deps deps-report models run gate test test-unit test-memcheck test-tp verify bench clean

all: $(LIB) $(UPF) $(TEST_BIN) $(BENCH_BIN) $(MPI_PLUGIN) $(TP_CHECK)

deps:
	bash ci/install-deps.sh

# `make run` also wants the report's plotting library
deps-report:
	bash ci/install-deps.sh --report

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

# The communicator's objects carry the MPI/NCCL flags; their own stamp rebuilds them when those change.
$(COMM_OBJ): CPPFLAGS += $(COMM_CPPFLAGS)
$(COMM_OBJ): NVCCFLAGS += $(COMM_NVCCFLAGS)
$(COMM_OBJ): $(COMM_STAMP)
$(COMM_STAMP): FORCE
	@mkdir -p $(dir $@)
	@echo '$(COMM_CPPFLAGS) | $(COMM_NVCCFLAGS) | $(MPI_CFLAGS) $(MPI_LIBS)' | cmp -s - $@ || \
	  echo '$(COMM_CPPFLAGS) | $(COMM_NVCCFLAGS) | $(MPI_CFLAGS) $(MPI_LIBS)' >$@

$(BUILD)/libupf_mpi.so: core/comm_mpi.c $(COMM_STAMP) $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(MPI_CFLAGS) $(CFLAGS) -fPIC -shared -o $@ $< $(MPI_LIBS)

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

# Tensor parallelism on CPU ranks (tests/tp/): a checker run under mpirun, built only with MPI.
$(BUILD)/tp_check: $(BUILD)/tests/tp/tp_check.o $(LIB)
	$(CXX) -o $@ $^ $(LDLIBS)

# The main job: verify what this machine's backends can run, benchmark, and summarise.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

run: deps-report
	$(MAKE) -j$(JOBS) all
	$(UPF) report --root $(BUILD)/report

# The report gate on this machine: the quick CPU reports of BASE (default: the merge base with origin/main,
# else HEAD~1) and of the checkout, compared (ci/report-gate.sh; exit 1 when the head regressed).
gate:
	bash ci/report-gate.sh $(if $(BASE),--base $(BASE)) $(if $(THRESHOLD),--threshold $(THRESHOLD))

# The CPU-only build of the suites under Valgrind memcheck first (the CUDA libraries' own load-time
# code, libcublasLt's constructors, is not ours to check and trips Valgrind in ld.so), then every
# suite of the full build, so the output ends with CUnit's run summary.
# The Valgrind pass is split over the two cores: most suites start at once on one core, while the other
# runs the native suites, the MPI runs, then the long model-level suites of VALGRIND_LATE under Valgrind
# (the split that balanced the two on CI's 2 cores). Logs $(BUILD)/memcheck{,-late}.log, printed after
# the native output; the exit status is that of all four.
MEMCHECK_LOG := $(BUILD)/memcheck.log
MEMCHECK_LATE_LOG := $(BUILD)/memcheck-late.log
VALGRIND_LATE := model 'model masked path'
VALGRIND_TEST = UPF_TEST_QUICK=1 valgrind --error-exitcode=3 --leak-check=full --errors-for-leak-kinds=definite \
  --show-leak-kinds=definite $(BUILD)-memcheck/test_upf
test: deps models
	@date '+make test: %T building'
	$(MAKE) -j$(JOBS) all
	$(MAKE) -j$(JOBS) CUDA=0 BUILD=$(BUILD)-memcheck $(BUILD)-memcheck/test_upf $(BUILD)-memcheck/upf
	@date '+make test: %T the CPU-only suites under Valgrind memcheck (quick set) start beside the native suites; log $(MEMCHECK_LOG)'
	@$(VALGRIND_TEST) --except $(VALGRIND_LATE) >$(MEMCHECK_LOG) 2>&1 & vg=$$!; \
	  $(TEST_BIN); native=$$?; \
	  date '+make test: %T tensor parallelism under mpirun'; bash tests/tp/run.sh $(BUILD); tp=$$?; \
	  date '+make test: %T the late suites (VALGRIND_LATE) under Valgrind memcheck; log $(MEMCHECK_LATE_LOG)'; \
	  $(VALGRIND_TEST) $(VALGRIND_LATE) >$(MEMCHECK_LATE_LOG) 2>&1; vglate=$$?; \
	  date '+make test: %T waiting for the Valgrind pass'; wait $$vg; vgrc=$$?; \
	  echo "make test: the Valgrind pass ($(MEMCHECK_LOG)):"; cat $(MEMCHECK_LOG); \
	  echo "make test: the Valgrind pass, late suites ($(MEMCHECK_LATE_LOG)):"; cat $(MEMCHECK_LATE_LOG); \
	  date "+make test: %T done: native suites exit $$native, tensor parallelism $$tp, Valgrind pass $$vgrc and $$vglate"; \
	  [ $$native -eq 0 ] && [ $$tp -eq 0 ] && [ $$vgrc -eq 0 ] && [ $$vglate -eq 0 ]

# Tensor parallelism under mpirun -np 2 and -np 4 (skipped, with the reason, without mpirun).
test-tp: all
	bash tests/tp/run.sh $(BUILD)

verify: all
	$(UPF) verify all

bench: all
	$(BENCH_BIN) --benchmark_out=$(BUILD)/bench.json --benchmark_out_format=json

clean:
	rm -rf $(BUILD)

# Fuzzing (fuzz/, fuzz/README.md): a libFuzzer target per parser, ASan + UBSan, built by clang in
# build-fuzz/ from the CPU-only sources compiled with the same flags. `make fuzz` builds them (clang is
# an optional dependency: `bash ci/install-deps.sh --fuzz`); `make fuzz-run FUZZ_SECONDS=600` runs each
# that long, FUZZ_JOBS at a time, and writes build-fuzz/SUMMARY.md; `make fuzz-seeds` rewrites the seed
# corpora of fuzz/corpus/ that are made by the library's writers.
FUZZ_TARGETS := npy gguf tokenizer trace args
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 600
FUZZ_JOBS ?= 2
FUZZ_SAN := -fsanitize=address,undefined -fno-sanitize-recover=all
FUZZ_BINS := $(FUZZ_TARGETS:%=$(BUILD)/fuzz/fuzz_%)
.PHONY: fuzz fuzz-run fuzz-seeds fuzz-bins
.SECONDARY: $(FUZZ_TARGETS:%=$(BUILD)/fuzz/fuzz_%.o)
fuzz:
	@command -v clang >/dev/null || { echo "make fuzz: clang is missing (bash ci/install-deps.sh --fuzz)"; exit 2; }
	$(MAKE) -j$(JOBS) CUDA=0 MPI=0 CC=clang CXX=clang++ OPT=-O1 BUILD=$(FUZZ_BUILD) \
	  SAN='$(FUZZ_SAN) -fsanitize=fuzzer-no-link' fuzz-bins
fuzz-bins: $(FUZZ_BINS) $(BUILD)/fuzz/seeds
fuzz-run: fuzz
	bash fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_JOBS) $(FUZZ_TARGETS)
fuzz-seeds: fuzz
	$(FUZZ_BUILD)/fuzz/seeds fuzz/corpus

$(BUILD)/fuzz/fuzz_%: $(BUILD)/fuzz/fuzz_%.o $(LIB)
	$(CXX) $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $^ $(LDLIBS) -lbenchmark

# the CLI target runs cli/upf.c's dispatch (its main renamed) with upf_args_parse wrapped
$(BUILD)/fuzz/upf_main.o: cli/upf.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -Dmain=upf_cli_main -c $< -o $@
$(BUILD)/fuzz/fuzz_args: $(BUILD)/fuzz/fuzz_args.o $(BUILD)/fuzz/upf_main.o \
	  $(filter-out $(BUILD)/cli/upf.o,$(CLI_SRC:%.c=$(BUILD)/%.o)) $(LIB)
	$(CXX) $(FUZZ_SAN) -fsanitize=fuzzer -Wl,--wrap=upf_args_parse -o $@ $^ $(LDLIBS) -lbenchmark

$(BUILD)/fuzz/seeds: $(BUILD)/fuzz/seeds.o $(LIB)
	$(CXX) $(FUZZ_SAN) -fsanitize=fuzzer-no-link -o $@ $^ $(LDLIBS) -lbenchmark

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
