# The two commands the README opens with: `make tour` and `make test`.
# Both set up the environment first (scripts/setup.sh), so they work on a fresh clone.
SHELL := /bin/bash
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: tour test lint lab info
tour:
	@py=$$(scripts/setup.sh) && $$py -m workbench tour

# The browser test (tests/browser, JupyterLab in Chromium) runs in the same pytest session, on one worker (three
# workers were slower here: the scheduler then started the browser test, the longest file, minutes late).
# (OMP_NUM_THREADS=1 for every process was tried and measured slower; the model tests pin torch to one thread.)
test:
	@py=$$(scripts/setup.sh) && scripts/setup_browser.sh && \
	$$py -m ruff check . && \
	WORKBENCH_REQUIRE_BROWSER=1 $$py -m pytest -n 2 --dist loadfile $(NBVAL) tests notebooks

lint:
	@py=$$(scripts/setup.sh) && $$py -m ruff check .

info:
	@py=$$(scripts/setup.sh) && $$py -m workbench info

lab:
	@py=$$(scripts/setup.sh) && $$py -m jupyter lab notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)  # root: containers, our machines
