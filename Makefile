# Every target sets up .venv (Python >= 3.12, pinned PyMC stack) on first use.
PY := .venv/bin/python

.PHONY: venv example test test-slow bench lint

venv:
	@bash scripts/venv.sh

example: venv
	$(PY) examples/a9a_logistic_regression.py

test: venv
	$(PY) -m pytest -n 2 --durations=15

test-slow: venv
	$(PY) -m pytest -n 2 -m slow --durations=15

bench: venv
	$(PY) benchmarks/run.py

lint: venv
	$(PY) -m ruff check pymc_sgmcmc tests examples benchmarks
	$(PY) -m ruff format --check pymc_sgmcmc tests examples benchmarks

# The documentation site, into docs/_build/html (installs the docs extra into .venv). A full
# rebuild (-E) with warnings as errors and every cross-reference resolved (-n).
.PHONY: docs
docs:
	@EXTRAS=test,docs bash scripts/venv.sh
	$(PY) -m sphinx -E -W --keep-going -n -b html docs docs/_build/html

# The papers' experiments in full mode (long: see examples/README.md); results in examples/output/.
.PHONY: examples
examples: venv
	for e in normal_gamma gmm1d_nogin linear_regression_w2 mnist_logistic drbm sgld_a9a; do \
		$(PY) examples/$$e.py || exit 1; done

# Benchmark suite (issue 4): every sampler inside pm.sample on P1-P4 and MNIST against a NumPy
# SGLD, BlackJAX SGLD/SGNHT (extra `bench`, installed here if missing) and PyMC NUTS; writes
# benchmarks/suite_results.md. Options: make bench-suite SUITE_ARGS="--quick" (or --nuts-p4, ...).
.PHONY: bench-suite
bench-suite: bench-extra
	$(PY) benchmarks/suite.py $(SUITE_ARGS)

# Issue 4's performance targets, each measured in one run (15 minutes on the AMD EPYC
# machine, 20-23 on the Intel Xeon one): writes benchmarks/criteria_results.md.
.PHONY: bench-criteria
bench-criteria: bench-extra
	$(PY) benchmarks/criteria.py

# The `bench` extra (BlackJAX, JAX, nutpie) for the baselines, installed into .venv if missing.
.PHONY: bench-extra
bench-extra: venv
	@$(PY) -c "import blackjax, jax, nutpie" 2>/dev/null || $(PY) -m pip install --quiet -e ".[bench]" \
		|| echo "note: BlackJAX/JAX/nutpie could not be installed: their baselines will be skipped"
