"""The kernels ``tour`` and ``report`` start talk over IPC: ipykernel's "Kernel is running over TCP without
encryption" warning, printed by every TCP kernel of a headless run, no longer hides a real warning (issue 30,
item 7). A real kernel runs a one-cell notebook each time (a few seconds)."""

import os

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from workbench.__main__ import main
from workbench.publish.page import local_kernel
from workbench.publish.site import execute_notebook

TCP_WARNING = "without encryption"


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "t.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("# t"), new_code_cell("print('hi from the kernel')")]), path)
    return path


@pytest.mark.skipif(os.name != "posix", reason="IPC needs Unix sockets; TCP elsewhere")
def test_tour_kernel_prints_no_tcp_warning(tiny, tmp_path, capfd):
    assert main(["tour", "--notebook", str(tiny), "--out", str(tmp_path / "out")]) == 0
    out, err = capfd.readouterr()
    assert "[1/1] cell 1" in out and TCP_WARNING not in err, err
    assert "hi from the kernel" in (tmp_path / "out" / "t.html").read_text()


@pytest.mark.skipif(os.name != "posix", reason="IPC needs Unix sockets; TCP elsewhere")
def test_report_kernel_prints_no_tcp_warning_and_leaves_no_socket_files(tiny, capfd):
    nb, _, error = execute_notebook(tiny, progress=False, timeout=120)
    _, err = capfd.readouterr()
    assert error is None and nb.cells[1].outputs[0]["text"] == "hi from the kernel\n"
    assert TCP_WARNING not in err, err
    with local_kernel() as kernel:
        folder = os.path.dirname(kernel["config"].KernelManager.ip)
        assert kernel["config"].KernelManager.transport == "ipc" and os.path.isdir(folder)
    assert not os.path.exists(folder)  # the sockets' folder goes with the run
