# The two commands the README opens with: `make tour` and `make test`.
# Both set up the environment first (scripts/setup.sh), so they work on a fresh clone.
SHELL := /bin/bash
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: tour test lint lab info
tour:
	@py=$$(scripts/setup.sh) && $$py -m workbench tour

# The browser test (tests/browser, JupyterLab in Chromium) runs in the same pytest session, in two files (two halves
# of the notebooks, each with its own JupyterLab) that start first, one on each worker: --no-loadscope-reorder keeps
# the collection order (xdist's default sends the files with the most tests first, and the browser test, the
# longest, started minutes late). Three workers, and OMP_NUM_THREADS=1, were measured slower on 2 cores.
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
