"""The suite's pytest entry point (``workbench.conformance.testing``): our decode kernel, one test per smoke case,
and a broken kernel's failure as an AssertionError that names the case and its replay."""

import functools

import pytest

from workbench import conformance as C
from workbench.conformance.starter import starter_decode
from workbench.conformance.testing import assert_conforms, cases_of

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]


@cases_of("starter", level="smoke")
def test_starter_conforms(case):
    assert_conforms("starter", case)


def test_a_failing_case_names_itself_and_its_replay():
    case = "decode/nhd/bs8/d80/hkv2/g4/bf16/lens=16,8/pad3/seed2"
    C.register("decode", "t_gqa", functools.partial(starter_decode, mistake="gqa"), layouts=("nhd",))
    try:
        with pytest.raises(AssertionError, match=r"relative error .*\n  replay: python -m workbench check t_gqa"):
            assert_conforms("t_gqa", case)
    finally:
        C.unregister("decode", "t_gqa")
