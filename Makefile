# Two entry points for a fresh machine:
#   make demo   set up (packages + default models), build, and run the main job
#   make test   set up, build, and run the tests
BUILD ?= build
JOBS ?= $(shell nproc)
DATA ?= $(abspath ../shared/data)
CMAKE_FLAGS ?=

.PHONY: setup configure build build-tests demo test test-asan check-package bench clean

setup:
	bash scripts/setup.sh

configure:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: setup build
	bash scripts/demo.sh $(BUILD)/focus $(DATA)

# The tests need the library, the command-line binary and the test binary (not the benchmarks).
build-tests: configure
	cmake --build $(BUILD) -j $(JOBS) --target focus focus_tests

# Two tests at a time, one thread each by default (tests of the threaded code set their own
# counts); waiting threads sleep instead of spinning, so two tests never fight over a core.
test: setup build-tests
	cd $(BUILD) && FOCUS_DATA=$(DATA) OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive \
	  ctest --output-on-failure -j 2 --timeout 900

# The installed library as another project sees it: install into a temporary prefix, build
# examples/ against it, run the example.
check-package: build
	bash scripts/check_package.sh $(BUILD) $(DATA)

bench: build
	$(BUILD)/focus_bench --json $(BUILD)/bench.json

# The whole test suite under AddressSanitizer + UBSan: the tests and the command-line binary on the
# sanitized library of the fuzzing build (clang -O1; scripts/fuzz.sh 0 builds it, fuzzing nothing),
# two shards side by side (scripts/test_asan.sh).
test-asan:
	bash scripts/fuzz.sh 0
	bash scripts/test_asan.sh $(DATA)

clean:
	rm -rf $(BUILD) build-fuzz
