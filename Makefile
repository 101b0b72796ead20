# k3shard build. One library (common/ + proto/) linked into two programs
# (k3-coordinator, k3-worker) and one test program per module
# (tests/test_<module>.c). Build variants live in separate folders so objects
# never mix: build/ (release), build-asan/, build-ubsan/, build-tsan/,
# build-fuzz/.
#
#   make            build/k3-coordinator build/k3-worker
#   make deps       install Debian packages (deploy/install-deps.sh)
#   make test       build, generate the tiny checkpoint, run every test; the
#                   last line is "N passed, N failed, N skipped"
#   make run        deps, build, tiny checkpoint, generate text with 2 local workers
#   make asan|ubsan|tsan   the same programs and tests, sanitized
#   make fuzz       libFuzzer targets, 60 s each (FUZZ_SECONDS=2 for a smoke run)
#   make format-check
#
# CFLAGS is the user's (default: $(OPT) -g, OPT=-O2): `make CFLAGS='-O0 -g'`
# replaces only that, never the flags the code needs (K3_CFLAGS). Each object
# depends on the headers it includes (-MMD -MP writes a .d next to it).
# Before anything runs, a goal that compiles checks the compiler and, with
# pkg-config, every library in PKGS, and one that generates a checkpoint
# checks numpy; a missing one stops make in its first line, naming it and
# `make deps`. deps, clean, format, format-check and bench-ab need none of
# them, and run checks nothing itself: it runs deps, then a new make.

BUILD    ?= build
CC       ?= cc
PY       := /usr/bin/python3
# The libraries the code links today (libmicrohttpd and jansson: the HTTP
# server, coordinator/serve*.c). deploy/install-deps.sh installs more
# (libedit for the chat prompt, liburing for tests/bench/bench_expert_io): a
# module that starts using one adds its pkg-config name here.
# tests/bench/bench-ab.sh reads this line.
PKGS     := libzmq msgpack hwloc libpcre2-8 jansson libmicrohttpd libedit
# The Debian package that holds each pkg-config module or compiler (for the
# message below).
DEB_cc         := build-essential
DEB_gcc        := build-essential
DEB_libzmq     := libzmq3-dev
DEB_msgpack    := libmsgpack-dev
DEB_hwloc      := libhwloc-dev
DEB_libpcre2-8 := libpcre2-dev
DEB_jansson    := libjansson-dev
DEB_libmicrohttpd := libmicrohttpd-dev
DEB_libedit    := libedit-dev
DEB_liburing   := liburing-dev

NOPKG_GOALS := deps clean format format-check run tiny slice bench-ab
NUMPY_GOALS := test tiny slice asan ubsan tsan
GOALS       := $(or $(MAKECMDGOALS),all)
DEPS_HINT   := run `make deps` (deploy/install-deps.sh) to install everything k3shard needs
# One shell: pkg-config --exists on the whole list (a few ms), and only when
# that fails once per package, to name each missing one. The whole check
# adds about 0.1 s to a make that has nothing to do.
ifneq ($(filter-out $(NOPKG_GOALS),$(GOALS)),)
PKG_MISSING := $(shell command -v pkg-config >/dev/null 2>&1 || { echo pkg-config; exit 0; }; \
                 pkg-config --exists $(PKGS) 2>/dev/null || \
                 for p in $(PKGS); do pkg-config --exists $$p 2>/dev/null || echo $$p; done)
CC_MISSING  := $(shell command -v $(firstword $(CC)) >/dev/null 2>&1 || echo $(firstword $(CC)))
ifneq ($(PKG_MISSING)$(strip $(CC_MISSING)),)
$(error missing $(foreach p,$(PKG_MISSING) $(CC_MISSING),$(p)$(if $(DEB_$(p)), ($(DEB_$(p))))); \
        $(DEPS_HINT))
endif
PKG_CFLAGS  := $(shell pkg-config --cflags $(PKGS))
PKG_LIBS    := $(shell pkg-config --libs $(PKGS))
endif
ifneq ($(filter $(NUMPY_GOALS),$(GOALS)),)
ifneq ($(shell $(PY) -c 'import numpy' 2>/dev/null && echo y),y)
$(error $(PY) cannot import numpy (python3-numpy), which generates the test checkpoint; \
        $(DEPS_HINT))
endif
endif

# -march=native stays off: kernels dispatch AVX2/AVX-512 at run time (cpuid)
# so one binary runs on any x86-64. -ffp-contract=off keeps the scalar paths
# free of compiler-chosen FMAs: the same source gives the same bits.
OPT      ?= -O2
CFLAGS   ?= $(OPT) -g
WARN     := -Wall -Wextra -Werror
K3_CFLAGS:= -std=c11 -D_GNU_SOURCE -I. -pthread -ffp-contract=off -fno-strict-aliasing \
            $(WARN) $(PKG_CFLAGS) $(SANFLAGS)
DEPFLAGS := -MMD -MP
# what every compile and link line starts with; CPPFLAGS, CFLAGS, LDFLAGS and
# LDLIBS stay the user's
COMPILE  = $(CC) $(K3_CFLAGS) $(CPPFLAGS) $(CFLAGS) $(DEPFLAGS)
K3_LDLIBS:= $(PKG_LIBS) -lm -pthread

# `make` alone builds the programs (the rule below would otherwise be the first)
.DEFAULT_GOAL := all

# The Vulkan expert tier (common/vk/, docs/VULKAN.md): compiled in when glslc
# and the vulkan pkg-config module are here (K3_HAVE_VK; the shaders'
# SPIR-V is embedded as C arrays); without them common/vk/vk.c builds its
# stubs and --vk says the option is unavailable. VK=0 leaves it out.
VK_SPV   := $(patsubst common/vk/shaders/%.comp,$(BUILD)/vk/%.spv.inc,$(wildcard common/vk/shaders/*.comp)) \
            $(BUILD)/vk/expert_f32.spv.inc
ifneq ($(VK),0)
ifeq ($(shell command -v glslc >/dev/null 2>&1 && pkg-config --exists vulkan 2>/dev/null && echo y),y)
K3_CFLAGS += -DK3_HAVE_VK=1 -I$(BUILD)/vk
K3_LDLIBS += $(shell pkg-config --libs vulkan)
$(BUILD)/common/vk/vk.o: $(VK_SPV)
endif
endif
$(BUILD)/vk/%.spv.inc: common/vk/shaders/%.comp
	@mkdir -p $(dir $@)
	glslc -O --target-env=vulkan1.1 -mfmt=num -o $@ $<
$(BUILD)/vk/%_f32.spv.inc: common/vk/shaders/%.comp
	@mkdir -p $(dir $@)
	glslc -O --target-env=vulkan1.1 -DK3_FMA_NATIVE -mfmt=num -o $@ $<

LIB_SRC  := $(wildcard common/*/*.c) $(wildcard proto/*.c)
COORD_SRC:= $(wildcard coordinator/*.c)
# The web UI's files (docs/WEB.md), compiled into the coordinator as byte
# arrays by coordinator/web/embed.sh (POSIX sh + od: no Node build step).
WEB_FILES:= $(sort $(wildcard coordinator/web/*.html coordinator/web/*.css coordinator/web/*.js \
                               coordinator/web/*.svg))
WEB_GEN  := $(BUILD)/gen/web_assets.c
WORK_SRC := $(wildcard worker/*.c)
TEST_SRC := $(wildcard tests/test_*.c)
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
COORD_OBJ:= $(COORD_SRC:%.c=$(BUILD)/%.o) $(WEB_GEN:.c=.o)
WORK_OBJ := $(WORK_SRC:%.c=$(BUILD)/%.o)
TEST_BIN := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
LIB      := $(BUILD)/libk3.a
PROGS    := $(BUILD)/k3-coordinator $(BUILD)/k3-worker

FIXTURES ?= $(BUILD)/fixtures
TINY     := $(FIXTURES)/tiny
CACHE    ?= $(HOME)/.cache/k3shard

.PHONY: all deps test run asan ubsan tsan fuzz format format-check clean reliability \
        tiny slice bench-experts bench-kernels bench-kernels-threads bench-layers bench-cluster bench-drives bench-serve bench-ab bench-vk bench-plan \
        tests-bin fuzz-bin

all: $(PROGS)

deps:
	bash deploy/install-deps.sh

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(COMPILE) -c $< -o $@

$(WEB_GEN): coordinator/web/embed.sh $(WEB_FILES)
	@mkdir -p $(dir $@)
	sh coordinator/web/embed.sh $@ $(WEB_FILES)
$(WEB_GEN:.c=.o): $(WEB_GEN)
	$(COMPILE) -c $< -o $@
# The build identity HELLO compares (proto/link.h, K3_LINK_BUILD): the source
# revision. build/rev.txt is rewritten only when the revision changes, so
# proto/link.o is recompiled then and only then.
K3_REV := $(shell git describe --always --dirty 2>/dev/null | tr -cd 'A-Za-z0-9._+-' || true)
K3_REV := $(or $(K3_REV),unknown)
$(BUILD)/rev.txt: FORCE
	@mkdir -p $(dir $@)
	@echo '$(K3_REV)' | cmp -s - $@ || echo '$(K3_REV)' >$@
$(BUILD)/proto/link.o: $(BUILD)/rev.txt
$(BUILD)/proto/link.o: K3_CFLAGS += -DK3_BUILD_REV='"$(K3_REV)"'
FORCE:

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/k3-coordinator: $(COORD_OBJ) $(LIB)
	$(CC) $(K3_CFLAGS) $(CFLAGS) $(LDFLAGS) -o $@ $(COORD_OBJ) $(LIB) $(LDLIBS) $(K3_LDLIBS)

$(BUILD)/k3-worker: $(WORK_OBJ) $(LIB)
	$(CC) $(K3_CFLAGS) $(CFLAGS) $(LDFLAGS) -o $@ $(WORK_OBJ) $(LIB) $(LDLIBS) $(K3_LDLIBS)

# Test programs may use worker/ and coordinator/ modules (all but main.c).
APP_OBJ := $(filter-out %/main.o,$(COORD_OBJ) $(WORK_OBJ))
$(BUILD)/tests/%: tests/%.c $(APP_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(COMPILE) $(LDFLAGS) -o $@ $< $(APP_OBJ) $(LIB) $(LDLIBS) $(K3_LDLIBS)

tests-bin: $(PROGS) $(TEST_BIN)

# Benchmark programs (tests/bench/*.c), built on demand by the bench scripts
# with the same flags and objects as the tests: `make build/bench/bench_kernels`.
# bench_expert_io compares the loader threads with io_uring, so it alone
# also links liburing (BENCH_PKGS, checked when it is built; the recursive
# BENCH_FLAGS asks pkg-config only for a program that has BENCH_PKGS).
$(BUILD)/bench/bench_expert_io: BENCH_PKGS := liburing
BENCH_FLAGS = $(if $(BENCH_PKGS),$(shell pkg-config --cflags --libs $(BENCH_PKGS) 2>/dev/null))
$(BUILD)/bench/%: tests/bench/%.c $(APP_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	@for p in $(BENCH_PKGS); do pkg-config --exists $$p 2>/dev/null || { \
	  echo "missing $$p, which $@ links; run \`make deps\` (deploy/install-deps.sh)" >&2; exit 1; }; done
	$(COMPILE) $(LDFLAGS) -o $@ $< $(APP_OBJ) $(LIB) $(LDLIBS) $(BENCH_FLAGS) $(K3_LDLIBS)

# The tiny checkpoint: seconds to generate, deterministic from its seed.
tiny: $(TINY)/config.json
$(TINY)/config.json: tests/fixtures/k3_gen.py tests/fixtures/corpus.txt
	$(PY) tests/fixtures/k3_gen.py --profile tiny --out $(TINY)

# The slice checkpoint (real K3 dimensions, a few layers, ~8 GB): benchmarks only.
slice:
	$(PY) tests/fixtures/k3_gen.py --profile slice --out $(CACHE)/slice

test: tests-bin tiny
	BUILD=$(BUILD) TINY=$(TINY) bash tests/run.sh

# Faults injected into a live tiny cluster, one table (docs/RELIABILITY.md).
reliability: tests-bin tiny
	BUILD=$(BUILD) TINY=$(TINY) bash tests/reliability/run.sh

# deps first, then a new make: this one read the Makefile before deps ran,
# so it has no library flags (and must not check for the libraries).
run: deps
	$(MAKE) --no-print-directory all tiny
	$(BUILD)/k3-coordinator --model $(TINY) --ngen 24 "The quick brown fox"

asan:
	$(MAKE) BUILD=build-asan SANFLAGS="-fsanitize=address -fno-omit-frame-pointer" OPT=-O1 test
# K3_SANITIZE_UNDEFINED: compilers define no macro for -fsanitize=undefined,
# and tests with time limits relax them under every sanitizer.
ubsan:
	$(MAKE) BUILD=build-ubsan SANFLAGS="-fsanitize=undefined -fno-sanitize-recover=all -DK3_SANITIZE_UNDEFINED" OPT=-O1 test
# TSan runs test_kernels' K3-size matrices for 15+ minutes on 2 cores, past
# tests/run.sh's 900 s per test: an hour each here. Suppressions and
# TSAN_OPTIONS: tests/tsan.supp, tests/tsan_env.sh.
tsan:
	PER_TEST_TIMEOUT=$${PER_TEST_TIMEOUT:-3600} \
	    $(MAKE) BUILD=build-tsan SANFLAGS="-fsanitize=thread" OPT=-O1 test

# libFuzzer targets (tests/fuzz/fuzz_*.c): clang, the library built with
# -fsanitize=fuzzer-no-link, the same K3_CFLAGS (warnings included) as
# everything else; `make fuzz` builds them in build-fuzz/ and runs each.
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=$(BUILD)/fuzz/%)
$(BUILD)/fuzz/%: tests/fuzz/%.c $(LIB)
	@mkdir -p $(dir $@)
	$(COMPILE) -fsanitize=fuzzer $(LDFLAGS) -o $@ $< $(LIB) $(LDLIBS) $(K3_LDLIBS)
fuzz-bin: $(FUZZ_BIN)
fuzz:
	$(MAKE) BUILD=build-fuzz CC=clang SANFLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-omit-frame-pointer" OPT=-O1 fuzz-bin
	@set -e; for f in $(FUZZ_SRC); do n=$$(basename $$f .c); \
	  mkdir -p build-fuzz/corpus/$$n; \
	  seeds=""; [ -d tests/corpus/$$n ] && seeds=tests/corpus/$$n; \
	  echo "fuzz: $$n for $${FUZZ_SECONDS:-60} s"; \
	  build-fuzz/fuzz/$$n -max_total_time=$${FUZZ_SECONDS:-60} -rss_limit_mb=512 -malloc_limit_mb=64 \
	    build-fuzz/corpus/$$n $$seeds; done

FORMAT_SRC := $(shell git ls-files '*.c' '*.h' 2>/dev/null)
format:
	clang-format -i $(FORMAT_SRC)
format-check:
	clang-format --dry-run --Werror $(FORMAT_SRC)

bench-experts bench-kernels bench-layers bench-cluster bench-drives bench-serve bench-vk bench-plan: tests-bin
	BUILD=$(BUILD) CACHE=$(CACHE) bash tests/bench/$@.sh

# issue 21's table, short: n = 1, 1 and 2 threads [THREADS=1,2,4 ROUNDS=7]
bench-kernels-threads:
	BUILD=$(BUILD) THREADS=$(THREADS) ROUNDS=$(ROUNDS) bash tests/bench/$@.sh

# Two revisions' kernel side by side: make bench-ab A=52c3c6c B=. K=int4 N=1
# [ROUNDS=40 THREADS=1 COPIES=1] (COPIES=40: the MXFP4 and int8 ones from RAM)
bench-ab:
	bash tests/bench/bench-ab.sh $(or $(A),HEAD) $(or $(B),.) $(or $(K),int4) $(or $(N),1) \
	    $(or $(ROUNDS),40) $(or $(THREADS),1) $(or $(COPIES),1)

clean:
	rm -rf build build-asan build-ubsan build-tsan build-fuzz

# what -MMD -MP wrote: each object's, test's, bench's and fuzz target's headers
-include $(wildcard $(BUILD)/*/*.d $(BUILD)/*/*/*.d)
