"""kernels/interpreter.py: the choices tests change under the interpreter come back when the block ends."""

from __future__ import annotations

import dataclasses

import pytest

import kernels.conv as conv_mod
import kernels.linear as linear_mod
import kernels.mlp as mlp_mod
import kernels.pool as pool_mod


def test_overrides_nest_and_restore_on_error():
    default = linear_mod.INTERPRETER.choice
    with linear_mod.INTERPRETER.override(tile=(16, 32, 32)) as outer:
        assert linear_mod.INTERPRETER.choice is outer and outer.tile == (16, 32, 32) and outer.split_k == 1
        with linear_mod.INTERPRETER.override(split_k=3):
            assert linear_mod.INTERPRETER.choice == dataclasses.replace(outer, split_k=3)  # from the outer choice
        assert linear_mod.INTERPRETER.choice is outer
        with pytest.raises(RuntimeError), linear_mod.INTERPRETER.override(split_k=2):
            raise RuntimeError
        assert linear_mod.INTERPRETER.choice is outer
    assert linear_mod.INTERPRETER.choice is default


def test_a_field_a_module_lacks_is_an_error_and_choices_are_frozen():
    with pytest.raises(TypeError), conv_mod.INTERPRETER.override(block_n=16):  # mlp's field, not conv's
        pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        pool_mod.INTERPRETER.choice.tile = (2, 4)


@pytest.mark.parametrize("module", [linear_mod, conv_mod, pool_mod, mlp_mod], ids=lambda m: m.__name__)
def test_defaults_are_what_a_plain_cpu_run_uses(module):
    """The dataclass's defaults, whatever ran before in this process: no test leaves an override behind."""
    assert module.INTERPRETER.choice == type(module.INTERPRETER.choice)()
