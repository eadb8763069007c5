# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv and install pinned dependencies on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml benchmarks/pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	@# numpy < 2.4: Triton 3.6's CPU interpreter converts 1-element arrays to Python ints.
	$(VPY) -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4" matplotlib pytest hypothesis safetensors
	$(VPY) -m pip install -q --no-deps -e .
	@# the benchmark harness (quilt_bench: bench / report / the benchmark cases), beside the library; tests use it
	$(VPY) -m pip install -q --no-deps -e benchmarks
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m quilt_attn demo

test: $(STAMP)
	@# Without a GPU the Triton kernels run through Triton's CPU interpreter.
	TRITON_INTERPRET=$$($(VPY) -c "import torch; print(0 if torch.cuda.is_available() else 1)") \
	  $(VPY) -m pytest -q tests

bench: $(STAMP)
	$(VPY) -m quilt_bench bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info benchmarks/*.egg-info
