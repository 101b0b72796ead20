# k3shard build. One library (common/ + proto/) linked into two programs
# (k3-coordinator, k3-worker) and one test program per module
# (tests/test_<module>.c). Build variants live in separate folders so objects
# never mix: build/ (release), build-asan/, build-ubsan/, build-tsan/.
#
#   make            build/k3-coordinator build/k3-worker
#   make deps       install Debian packages (deploy/install-deps.sh)
#   make test       build, generate the tiny checkpoint, run every test
#   make run        deps, build, tiny checkpoint, generate text with 2 local workers
#   make asan|ubsan|tsan   the same programs and tests, sanitized
#   make fuzz       libFuzzer targets, 60 s each
#   make format-check

BUILD    ?= build
CC       ?= cc
PY       := /usr/bin/python3
PKGS     := libzmq msgpack hwloc libpcre2-8 jansson libmicrohttpd libedit liburing
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)

# -march=native stays off: kernels dispatch AVX2/AVX-512 at run time (cpuid)
# so one binary runs on any x86-64. -ffp-contract=off keeps the scalar paths
# free of compiler-chosen FMAs: the same source gives the same bits.
OPT      ?= -O2
CFLAGS   ?= $(OPT) -g
CFLAGS   += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -ffp-contract=off \
            -fno-strict-aliasing -I. $(PKG_CFLAGS) $(SANFLAGS)
LDLIBS   += $(PKG_LIBS) -lm -pthread $(SANFLAGS)

LIB_SRC  := $(wildcard common/*/*.c) $(wildcard proto/*.c)
COORD_SRC:= $(wildcard coordinator/*.c)
WORK_SRC := $(wildcard worker/*.c)
TEST_SRC := $(wildcard tests/test_*.c)
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
COORD_OBJ:= $(COORD_SRC:%.c=$(BUILD)/%.o)
WORK_OBJ := $(WORK_SRC:%.c=$(BUILD)/%.o)
TEST_BIN := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
LIB      := $(BUILD)/libk3.a
PROGS    := $(BUILD)/k3-coordinator $(BUILD)/k3-worker

FIXTURES ?= $(BUILD)/fixtures
TINY     := $(FIXTURES)/tiny
CACHE    ?= $(HOME)/.cache/k3shard

.PHONY: all deps test run asan ubsan tsan fuzz format format-check clean \
        tiny slice bench-experts bench-kernels bench-layers bench-cluster bench-drives bench-ab \
        tests-bin

all: $(PROGS)

deps:
	bash deploy/install-deps.sh

$(BUILD)/%.o: %.c $(wildcard common/*/*.h proto/*.h coordinator/*.h worker/*.h tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/k3-coordinator: $(COORD_OBJ) $(LIB)
	$(CC) $(CFLAGS) -o $@ $(COORD_OBJ) $(LIB) $(LDLIBS)

$(BUILD)/k3-worker: $(WORK_OBJ) $(LIB)
	$(CC) $(CFLAGS) -o $@ $(WORK_OBJ) $(LIB) $(LDLIBS)

# Test programs may use worker/ and coordinator/ modules (all but main.c).
APP_OBJ := $(filter-out %/main.o,$(COORD_OBJ) $(WORK_OBJ))
$(BUILD)/tests/%: tests/%.c $(APP_OBJ) $(LIB) $(wildcard tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(APP_OBJ) $(LIB) $(LDLIBS)

tests-bin: $(PROGS) $(TEST_BIN)

# Benchmark programs (tests/bench/*.c), built on demand by the bench scripts
# with the same flags and objects as the tests: `make build/bench/bench_kernels`.
$(BUILD)/bench/%: tests/bench/%.c $(APP_OBJ) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(APP_OBJ) $(LIB) $(LDLIBS)

# The tiny checkpoint: seconds to generate, deterministic from its seed.
tiny: $(TINY)/config.json
$(TINY)/config.json: tests/fixtures/k3_gen.py tests/fixtures/corpus.txt
	$(PY) tests/fixtures/k3_gen.py --profile tiny --out $(TINY)

# The slice checkpoint (real K3 dimensions, a few layers, ~8 GB): benchmarks only.
slice:
	$(PY) tests/fixtures/k3_gen.py --profile slice --out $(CACHE)/slice

test: tests-bin tiny
	BUILD=$(BUILD) TINY=$(TINY) bash tests/run.sh

run: deps all tiny
	$(BUILD)/k3-coordinator --model $(TINY) --ngen 24 "The quick brown fox"

asan:
	$(MAKE) BUILD=build-asan SANFLAGS="-fsanitize=address -fno-omit-frame-pointer" OPT=-O1 test
ubsan:
	$(MAKE) BUILD=build-ubsan SANFLAGS="-fsanitize=undefined -fno-sanitize-recover=all" OPT=-O1 test
# TSan runs test_kernels' K3-size matrices for 15+ minutes on 2 cores, past
# tests/run.sh's 900 s per test: an hour each here. Suppressions and
# TSAN_OPTIONS: tests/tsan.supp, tests/tsan_env.sh.
tsan:
	PER_TEST_TIMEOUT=$${PER_TEST_TIMEOUT:-3600} \
	    $(MAKE) BUILD=build-tsan SANFLAGS="-fsanitize=thread" OPT=-O1 test

FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
fuzz:
	$(MAKE) BUILD=build-fuzz CC=clang SANFLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-omit-frame-pointer" OPT=-O1 build-fuzz/libk3.a
	@mkdir -p build-fuzz/fuzz
	@set -e; for f in $(FUZZ_SRC); do n=$$(basename $$f .c); \
	  clang -std=c11 -D_GNU_SOURCE -g -O1 -I. $(PKG_CFLAGS) -fsanitize=fuzzer,address,undefined \
	    -o build-fuzz/fuzz/$$n $$f build-fuzz/libk3.a $(PKG_LIBS) -lm -pthread; \
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

bench-experts bench-kernels bench-layers bench-cluster bench-drives: tests-bin
	BUILD=$(BUILD) CACHE=$(CACHE) bash tests/bench/$@.sh

# Two revisions' kernel side by side: make bench-ab A=52c3c6c B=. K=int4 N=1
# [ROUNDS=40 THREADS=1 COPIES=1] (COPIES=40: the MXFP4 and int8 ones from RAM)
bench-ab:
	bash tests/bench/bench-ab.sh $(or $(A),HEAD) $(or $(B),.) $(or $(K),int4) $(or $(N),1) \
	    $(or $(ROUNDS),40) $(or $(THREADS),1) $(or $(COPIES),1)

clean:
	rm -rf build build-asan build-ubsan build-tsan build-fuzz
