# Pion — the two set-up commands (see README):
#   make run    installs dependencies, builds, and runs pion-server with working defaults
#   make test   installs dependencies, builds, and runs every test (unit, end-to-end, fuzz)
# Developer targets: build, unit, e2e, fuzz, fuzz-long, asan, tsan, bench, format, test-gpu.

BUILD      ?= build
JOBS       ?= $(shell nproc)
PYTHON     ?= /usr/bin/python3
FUZZ_SECS  ?= 60
CMAKE_ARGS ?=

.PHONY: deps build run test unit e2e fuzz fuzz-build fuzz-long asan tsan bench format format-check clean test-gpu gpu-bundle

deps:
	@scripts/install-deps.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/pion-server

unit: build
	cd $(BUILD) && ctest --output-on-failure -L unit -j $(JOBS) --timeout 300

e2e: build
	PION_SERVER=$(CURDIR)/$(BUILD)/pion-server $(PYTHON) -m pytest -q tests

fuzz-build: deps
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DPION_FUZZ=ON -DPION_SANITIZE=address -DPION_BUILD_TESTS=OFF -DPION_CUDA=OFF
	cmake --build build-fuzz -j $(JOBS) --target resp_parser_fuzz binary_frame_fuzz command_fuzz

# Short fuzz runs under ASan+UBSan (part of `make test`): the RESP parser, the binary
# protocol's frame parser, and the command fuzzer (argument vectors over every command,
# against a whole server in process), FUZZ_SECS each.
# Leaks: checked once, by LeakSanitizer after the server's clean shutdown at exit (per-input
# checks would rescan the whole server's heap after every new input, halving the exec rate).
COMMAND_FUZZ_FLAGS = -timeout=30 -max_len=4096 -detect_leaks=0
fuzz: fuzz-build
	scripts/run-fuzz.sh build-fuzz/resp_parser_fuzz fuzz/corpus/resp $(FUZZ_SECS)
	scripts/run-fuzz.sh build-fuzz/binary_frame_fuzz fuzz/corpus/binary $(FUZZ_SECS)
	FUZZ_FLAGS="$(COMMAND_FUZZ_FLAGS)" \
	  scripts/run-fuzz.sh build-fuzz/command_fuzz fuzz/corpus/command $(FUZZ_SECS)

# Long runs: FUZZ_RUNS executions of each parser (fails with fewer, or on any finding), then
# the command fuzzer for FUZZ_COMMAND_SECS. Results: bench/results/fuzz-*.md.
FUZZ_RUNS         ?= 10000000
FUZZ_COMMAND_SECS ?= 1800
fuzz-long: fuzz-build
	scripts/run-fuzz.sh build-fuzz/resp_parser_fuzz fuzz/corpus/resp 7200 $(FUZZ_RUNS)
	scripts/run-fuzz.sh build-fuzz/binary_frame_fuzz fuzz/corpus/binary 7200 $(FUZZ_RUNS)
	FUZZ_FLAGS="$(COMMAND_FUZZ_FLAGS)" \
	  scripts/run-fuzz.sh build-fuzz/command_fuzz fuzz/corpus/command $(FUZZ_COMMAND_SECS)

test: build
	$(MAKE) format-check unit e2e fuzz
	@echo "make test: all suites passed"

asan: deps
	cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPION_SANITIZE=address -DPION_CUDA=OFF
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ctest --output-on-failure -L unit --timeout 600
	PION_SERVER=$(CURDIR)/build-asan/pion-server $(PYTHON) -m pytest -q tests

tsan: deps
	cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPION_SANITIZE=thread -DPION_CUDA=OFF
	cmake --build build-tsan -j $(JOBS)
	cd build-tsan && ctest --output-on-failure -L unit --timeout 600
	PION_SERVER=$(CURDIR)/build-tsan/pion-server $(PYTHON) -m pytest -q tests

# The CUDA backend's tests, on a machine with an NVIDIA GPU (see scripts/test-gpu.sh).
test-gpu: build
	PYTHON=$(PYTHON) PION_GPU_BIN=$(BUILD) scripts/test-gpu.sh

# What a GPU machine without Debian packages needs to run test-gpu and the GPU benches.
gpu-bundle: build
	scripts/gpu-bundle.sh $(BUILD)

bench: build
	$(PYTHON) bench/bench_protocol.py --pion $(BUILD)/pion-server

format:
	clang-format -i $$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')

format-check: deps
	clang-format --dry-run --Werror $$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD) build-fuzz build-asan build-tsan
