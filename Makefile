# stepguard: the two contract commands are `make demo` and `make test`.
PY      := .venv/bin/python
MESON   := .venv/bin/meson
NATIVE  := build/native
ASAN    := build/asan
TSAN    := build/tsan
FUZZ    := build/fuzz
FUZZ_SECONDS ?= 30
CFILES   = $(shell git ls-files '*.c' '*.h' '*.cpp')

.PHONY: all bootstrap build test test-c test-py test-long test-hsdp-matrix test-torchft gpu-check gpu-prepare demo demo-hsdp demo-lighthouse soak soak-short bench sanitize fuzz format format-check clean

all: build

bootstrap:
	@scripts/bootstrap

# configure a C build tree once; reconfigure happens automatically in ninja
$(NATIVE)/build.ninja: | bootstrap
	$(MESON) setup $(NATIVE) -Dpython=false
$(ASAN)/build.ninja: | bootstrap
	$(MESON) setup $(ASAN) -Dpython=false -Dsanitizer=asan -Db_lundef=false
$(TSAN)/build.ninja: | bootstrap
	$(MESON) setup $(TSAN) -Dpython=false -Dsanitizer=tsan -Db_lundef=false

build: bootstrap $(NATIVE)/build.ninja
	$(MESON) compile -C $(NATIVE)
	$(PY) -c 'import stepguard._C'

test-c: build
	$(MESON) test -C $(NATIVE) --print-errorlogs

test-py: build
	$(PY) -m pytest tests/py -m "not long"

# the combinations left out of make test (marked long): torchtitan's FT
# path with FT-HSDP at 1 rank per group and DiLoCo at 2 (about 2 minutes)
test-long: build
	$(PY) -m pytest tests/py -m long

test: format-check test-c test-py

# the full product of FT-HSDP's options (make test runs them pairwise; make test-long too)
test-hsdp-matrix: build
	$(PY) -m pytest tests/py/test_hsdp.py -m long -k test_matrix

# torchft's own test files, from its pinned wheel, against stepguard (torchft
# mode); CI runs it after make test (about 4.5 minutes here);
# docs/training-api.md says where it stands and what is left out
test-torchft: build
	scripts/torchft-suite

# the CUDA paths on one GPU (docs/gpu.md): builds the extension from the
# packages that gpu-prepare gathers in .gpu/ and runs the CUDA checks; where
# no GPU can be used it prints "SKIP: no GPU: <reason>" and builds nothing
gpu-check:
	scripts/gpu-check

gpu-prepare:
	scripts/gpu-prepare

# the main job: three replica groups train a small Llama for about three
# minutes while one is killed every ~20 s; writes demo-out/
demo: build
	$(PY) examples/demo.py

# FT-HSDP, the blog's structure: FSDP2 inside 2-rank replica groups, the
# Manager across them, a random rank killed every ~20 s; writes demo-hsdp-out/
demo-hsdp: build
	$(PY) examples/demo.py --groups 2 --ranks 2 --fsdp --duration 120 --out demo-hsdp-out

# the smaller demonstrations: a kill under both lighthouses, fork safety
demo-lighthouse: build
	$(PY) examples/lighthouse_demo.py
	$(PY) examples/fork_safety_demo.py

# the chaos soak: replica groups of two ranks under a seeded mix of faults
# for SOAK_MINUTES (default 50: over 200 faults), then the history checker;
# writes SOAK_OUT (default soak-out/; docs/soak.md).  soak-short is the CI
# size (under 8 min, >= 20 faults, every kind).
SOAK_MINUTES ?= 50
SOAK_SEED ?= 1
SOAK_OUT ?= soak-out
soak: build
	$(PY) -m stepguard.soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED) --out $(SOAK_OUT)

soak-short: build
	$(PY) -m stepguard.soak --short --seed $(SOAK_SEED) --out $(SOAK_OUT)

# every benchmark, each against its competitor in the same run (torchft,
# torch Gloo, the loopback limit); each writes bench/results/
bench: build
	$(PY) bench/lighthouse.py --build-dir $(NATIVE)
	$(PY) bench/manager.py
	$(PY) bench/allreduce.py
	$(PY) bench/quantized.py
	$(PY) bench/recovery.py
	$(PY) bench/step.py
	$(PY) bench/e2e.py
	$(PY) bench/hsdp.py
	$(PY) bench/lighthouse_failover.py
	$(PY) bench/parameter_server.py
	$(PY) bench/data.py
	$(PY) bench/links.py
	$(PY) bench/spares.py

sanitize: bootstrap $(ASAN)/build.ninja $(TSAN)/build.ninja
	$(MESON) test -C $(ASAN) --print-errorlogs
	$(MESON) test -C $(TSAN) --print-errorlogs

$(FUZZ)/build.ninja: | bootstrap
	CC=clang $(MESON) setup $(FUZZ) -Dpython=false -Dtests=false -Dfuzz=true -Db_lundef=false

# each libFuzzer target for FUZZ_SECONDS, starting from its checked-in corpus
fuzz: $(FUZZ)/build.ninja
	$(MESON) compile -C $(FUZZ)
	@for t in $(FUZZ)/fuzz/fuzz_*; do \
	  [ -f "$$t" ] && [ -x "$$t" ] || continue; \
	  name=$${t##*/fuzz_}; mkdir -p $(FUZZ)/corpus-$$name; \
	  echo "fuzz: $$name for $(FUZZ_SECONDS) s"; \
	  $$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    $(FUZZ)/corpus-$$name fuzz/corpus/$$name || exit 1; \
	done

format:
	clang-format -i $(CFILES)

format-check: bootstrap
	clang-format --dry-run -Werror $(CFILES)

clean:
	rm -rf build
