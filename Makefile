# The two commands the README opens with: `make tour` and `make test`.
# Both set up the environment first (scripts/setup.sh), so they work on a fresh clone.
SHELL := /bin/bash
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: tour test lint lab info
tour:
	@py=$$(scripts/setup.sh) && $$py -m workbench tour

# The browser test (tests/browser, JupyterLab in Chromium), the longest file, runs in the same pytest session on one
# worker from the start: --no-loadscope-reorder keeps the collection order (xdist's default sends the files with
# the most tests first, and the browser test started minutes late). Measured slower on 2 cores: three workers,
# OMP_NUM_THREADS=1, and the browser test split in two halves (two browsers at once).
test:
	@py=$$(scripts/setup.sh) && scripts/setup_browser.sh && \
	$$py -m ruff check . && \
	WORKBENCH_REQUIRE_BROWSER=1 $$py -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(NBVAL) tests notebooks

lint:
	@py=$$(scripts/setup.sh) && $$py -m ruff check .

info:
	@py=$$(scripts/setup.sh) && $$py -m workbench info

lab:
	@py=$$(scripts/setup.sh) && $$py -m jupyter lab notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)  # root: containers, our machines
