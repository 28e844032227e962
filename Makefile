# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck clean install system-deps bench bench-full tracker-venv hf-venv tft-venv ray-venv deepspeed-ops deepspeed-ops-background

install: $(STAMP)

# torch is pinned first: these machines hold a CPU wheel of 2.13.0; an unpinned torch pulls a multi-GB CUDA build.
# DeepSpeed builds against the installed torch, so it cannot use pip's isolated build.
# With BUILD_DEEPSPEED_OPS=1 (`make test` on a fresh clone) DeepSpeed's two CPU extensions compile in the
# background while pip installs the rest, which leaves a core idle: 225 CPU-s that the tests' busiest part
# would otherwise spend (tools/build_deepspeed_ops.py; its output goes to .tmp/build_deepspeed_ops.log).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 setuptools wheel
	$(PY) -m pip install --quiet --no-build-isolation deepspeed==0.19.8
	if [ -n "$(BUILD_DEEPSPEED_OPS)" ]; then $(MAKE) --no-print-directory deepspeed-ops-background; fi
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# DeepSpeed's CPU extensions, built once per venv. `deepspeed-ops-background` starts the build unless it is done
# ($(DS_OPS) exists) or already running (its pid in .tmp); `deepspeed-ops` waits for it (torch's lock file makes a
# second build of the same extension wait for the first, then load it) or builds in the foreground. `make test`
# starts it early and waits before pytest, so after `make demo` (which left the stamp and no build) no test
# compiles an extension inside its own time bound.
DS_OPS := $(VENV)/.deepspeed-ops
DS_OPS_PID := .tmp/build_deepspeed_ops.pid
deepspeed-ops-background:
	@if [ ! -f $(DS_OPS) ] && ! { [ -f $(DS_OPS_PID) ] && kill -0 "$$(cat $(DS_OPS_PID))" 2>/dev/null; }; then \
	  mkdir -p .tmp; setsid $(PY) tools/build_deepspeed_ops.py --marker $(DS_OPS) \
	    > .tmp/build_deepspeed_ops.log 2>&1 < /dev/null & echo $$! > $(DS_OPS_PID); fi

deepspeed-ops: $(STAMP)
	@[ -f $(DS_OPS) ] || $(PY) tools/build_deepspeed_ops.py --marker $(DS_OPS)

# OS packages some launch tests need (OpenMPI for mpirun; SLURM + munge for the 2-node cluster; iproute2
# for the network-namespace machines). Best effort, root with apt-get only: the tests skip, naming what
# is missing, where they cannot be installed. CI runs it before `make test` (.ci/run).
SYSTEM_DEPS := mpirun:openmpi-bin slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge ip:iproute2 nft:nftables
system-deps:
	@missing=""; for pair in $(SYSTEM_DEPS); do command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then echo "system-deps: not root with apt-get; missing:$$missing"; exit 0; fi; \
	(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null 2>&1 \
	  || echo "system-deps: could not install$$missing"

# Aim, DVCLive, SwanLab and Trackio (tests/tracking/test_tracking_local.py): their packages pin older protobuf, pillow,
# filelock and python-dateutil than .venv holds, and DVCLive brings DVC (~57 packages), so they get a venv of
# their own. It sees .venv's packages (torch, hasten's deps) *behind* its own through a .pth file, so it only
# adds those four (about 90 packages, 380 MB, 3 minutes on 2 loaded cores) and .venv is never downgraded:
# pip does not uninstall what lies outside the venv it runs in.
TRACKER_VENV := .tracker-venv
TRACKER_PY := $(TRACKER_VENV)/bin/python
TRACKER_STAMP := $(TRACKER_VENV)/.installed

$(TRACKER_STAMP): $(STAMP) pyproject.toml
	test -x $(TRACKER_PY) || $(PYTHON) -m venv $(TRACKER_VENV)
	$(PY) -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > "$$($(TRACKER_PY) -c 'import site; print(site.getsitepackages()[0])')/zz_hasten_venv.pth"
	$(TRACKER_PY) -m pip install --quiet --upgrade pip
	$(TRACKER_PY) -m pip install --quiet -e '.[aim,dvclive,swanlab,trackio]'
	touch $(TRACKER_STAMP)

tracker-venv: $(TRACKER_STAMP)

# Transformers' Trainer, TRL, PEFT and diffusers on hasten (tests/test_hf_stack*.py): trl, peft and diffusers declare
# Accelerate as a dependency, so they go in with --no-deps into a venv layered over .venv (transformers is already
# there) and find hasten through `hasten.install_as_accelerate()`; `datasets` (TRL's trainers need it) brings
# pyarrow, dill and multiprocess. A second venv layered over that one adds the real Accelerate 1.15 for the test
# that compares the losses of the same script on both. 43 s cold on 2 loaded cores (pip cache warm), 310 MB.
HF_VENV := .hf-venv
HF_PY := $(HF_VENV)/bin/python
HF_STAMP := $(HF_VENV)/.installed
HF_ACC_VENV := .hf-acc-venv
HF_ACC_PY := $(HF_ACC_VENV)/bin/python

$(HF_STAMP): $(STAMP)
	test -x $(HF_PY) || $(PYTHON) -m venv $(HF_VENV)
	$(PY) -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > "$$($(HF_PY) -c 'import site; print(site.getsitepackages()[0])')/zz_hasten_venv.pth"
	$(HF_PY) -m pip install --quiet --no-deps trl==1.16.0 peft==0.21.2 diffusers==0.42.1
	$(HF_PY) -m pip install --quiet datasets==5.2.0
	test -x $(HF_ACC_PY) || $(PYTHON) -m venv $(HF_ACC_VENV)
	$(HF_PY) -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > "$$($(HF_ACC_PY) -c 'import site; print(site.getsitepackages()[0])')/zz_hf_venv.pth"
	$(HF_ACC_PY) -m pip install --quiet --no-deps accelerate==1.15.0
	touch $(HF_STAMP)

hf-venv: $(HF_STAMP)

# torchft (per-step fault tolerance with replica groups, docs/fault-tolerance.md; tests/fault_tolerance/): its wheel
# carries the Lighthouse and a Rust extension. It goes in a venv layered over .venv like the one above, so that
# .venv stays as it is: `pip install torchft==0.2.0` adds only torchft and setuptools (torch is found behind it).
TFT_VENV := .tft-venv
TFT_PY := $(TFT_VENV)/bin/python
TFT_STAMP := $(TFT_VENV)/.installed

$(TFT_STAMP): $(STAMP)
	test -x $(TFT_PY) || $(PYTHON) -m venv $(TFT_VENV)
	$(PY) -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > "$$($(TFT_PY) -c 'import site; print(site.getsitepackages()[0])')/zz_hasten_venv.pth"
	$(TFT_PY) -m pip install --quiet torchft==0.2.0
	touch $(TFT_STAMP)

tft-venv: $(TFT_STAMP)

# Ray Train (tests/integrations/): `ray[train]` in a venv layered over .venv like the tracker venv (a .pth file
# puts .venv's packages behind its own), so it adds only Ray and what Ray Train needs that .venv lacks (pyarrow,
# tensorboardX). 13 s on 2 loaded cores with the wheels in pip's cache; 436 MB.
RAY_VENV := .ray-venv
RAY_PY := $(RAY_VENV)/bin/python
RAY_STAMP := $(RAY_VENV)/.installed

$(RAY_STAMP): $(STAMP)
	test -x $(RAY_PY) || $(PYTHON) -m venv $(RAY_VENV)
	$(PY) -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > "$$($(RAY_PY) -c 'import site; print(site.getsitepackages()[0])')/zz_hasten_venv.pth"
	$(RAY_PY) -m pip install --quiet 'ray[train]==2.60.0'
	touch $(RAY_STAMP)

ray-venv: $(RAY_STAMP)

demo: $(STAMP)
	$(PY) -m compileall -q src >/dev/null
	OMP_NUM_THREADS=1 $(VENV)/bin/hasten launch --num_processes 2 examples/mnist_digits.py

# mypy (configured in pyproject.toml) checks src/ first: a type error fails the run before the tests start.
# The two layered venvs and mypy only read .venv, so they run side by side (mypy takes ~70 s cold): about two
# minutes less on a fresh clone, and a type error still fails the run before the tests start.
# compileall: where PYTHONDONTWRITEBYTECODE is set (as on these machines), nothing caches hasten's own modules
# (the editable install is not compiled by pip), so every launcher and worker would compile them again:
# ~0.25 CPU-s per process, hundreds of processes per run. Writing the .pyc files once takes ~2 s.
# The suite runs in two parts. Most files run on TEST_WORKERS pytest-xdist workers, a file per worker at a
# time (`--dist loadfile`: module fixtures such as a built cluster stay in one process). The launch tests
# leave a core idle while a launcher imports torch or a worker waits (a serial run of them used ~1.2 of the
# 2 cores); on 2 workers the whole suite took 17m54s instead of ~24 min. The tests marked `serial`
# (wall-clock bounds such as "every machine stops within 10 s", the SLURM cluster's daemons) then run
# alone, as they would on a quiet machine.
TEST_WORKERS ?= 2
TEST_ENV = HASTEN_TRACKER_PYTHON=$(CURDIR)/$(TRACKER_PY) HASTEN_HF_PYTHON=$(CURDIR)/$(HF_PY) \
  HASTEN_HF_ACCELERATE_PYTHON=$(CURDIR)/$(HF_ACC_PY) \
  HASTEN_TORCHFT_PYTHON=$(CURDIR)/$(TFT_PY) HASTEN_RAY_PYTHON=$(CURDIR)/$(RAY_PY) TMPDIR=$(CURDIR)/.tmp OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo

test: system-deps
	$(MAKE) --no-print-directory $(STAMP) BUILD_DEEPSPEED_OPS=1
	$(MAKE) --no-print-directory deepspeed-ops-background
	$(MAKE) --no-print-directory -j3 $(TRACKER_STAMP) $(HF_STAMP) $(TFT_STAMP) $(RAY_STAMP) typecheck
	$(MAKE) --no-print-directory deepspeed-ops
	mkdir -p .tmp
	$(PY) -m compileall -q src >/dev/null
	$(TEST_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" --basetemp=$(CURDIR)/.tmp/pytest \
	  $(PYTEST_ARGS); parallel=$$?; \
	$(TEST_ENV) $(PY) -m pytest -m serial --basetemp=$(CURDIR)/.tmp/pytest-serial $(PYTEST_ARGS); serial=$$?; \
	echo "make test: parallel part exit $$parallel, serial part exit $$serial (5: nothing selected)"; \
	[ $$parallel = 0 -o $$parallel = 5 ] && [ $$serial = 0 -o $$serial = 5 ] && [ $$parallel$$serial != 55 ]

typecheck: $(STAMP)
	$(PY) -m mypy

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(TRACKER_VENV) $(HF_VENV) $(HF_ACC_VENV) $(TFT_VENV) $(RAY_VENV) .tmp .mypy_cache

# Benchmarks run in their own venv, which also holds Accelerate (measured beside hasten in the same run);
# the project's .venv never gets it. `make bench`: the quick growth curves (a few minutes on 2 cores, a
# smoke test, outputs in .tmp/bench); `make bench-full`: the documented figures, into docs/scaling/.
BENCH_VENV := .bench-venv
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install --quiet --upgrade pip
	$(BENCH_PY) -m pip install --quiet torch==2.13.0 setuptools wheel
	$(BENCH_PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo $(BENCH_PY) benchmarks/run_benchmarks.py --quick

bench-full: $(BENCH_STAMP)
	OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo $(BENCH_PY) benchmarks/run_benchmarks.py --repeats $(or $(REPEATS),3)

# The documentation site (docs/ + API reference from the docstrings) into site/; any warning fails it.
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site
