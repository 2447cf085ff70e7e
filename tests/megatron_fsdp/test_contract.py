"""The target contract (tests/contract.py) for every standalone megatron-fsdp target, on this release."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import EXPECTED

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import contract  # noqa: E402

COMPONENT = "megatron-fsdp"
TARGETS = contract.params(COMPONENT)


def expect(target) -> str:
    return EXPECTED[target.name]


@pytest.mark.parametrize("order", ["gemm_patch first", "module first"])
@pytest.mark.parametrize("target", TARGETS)
def test_import_order(target, order):
    contract.check_import_order(target, expect(target), order, COMPONENT)


@pytest.mark.parametrize("target", TARGETS)
def test_apply_revert_apply(target):
    contract.check_apply_revert_apply(target, expect(target))


@pytest.mark.parametrize("target", TARGETS)
def test_reload_keeps_it_patched(target):
    contract.check_reload(target, expect(target))


@pytest.mark.parametrize("target", TARGETS)
def test_reimport_patches_the_new_module_and_keeps_the_old(target):
    contract.check_reimport(target, expect(target))


@pytest.mark.parametrize("target", TARGETS)
def test_replaced_object_is_left_alone(target):
    contract.check_replaced(target, expect(target))


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("target", TARGETS)
def test_unknown_code_is_left_alone(target, strict):
    contract.check_unknown_code(target, expect(target), strict)


@pytest.mark.parametrize("target", TARGETS)
def test_disable_leaves_it_off(target):
    contract.check_disable(target, expect(target))


@pytest.mark.parametrize("target", TARGETS)
def test_not_applicable_changes_nothing(target):
    contract.check_not_applicable(target, expect(target))
