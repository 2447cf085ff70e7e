import pytest

from gemm_patch import config


def test_defaults():
    cfg = config.load({})
    assert (cfg.enabled, cfg.strict, cfg.backend, cfg.log_level, cfg.apex_shim) == (True, False, "auto", "INFO", True)


@pytest.mark.parametrize("raw,expected", [("0", False), ("off", False), ("FALSE", False), ("1", True), (" yes ", True)])
def test_flags(raw, expected):
    assert config.load({"GEMM_PATCH": raw}).enabled is expected


@pytest.mark.parametrize(
    "var,value,accepted",
    [
        ("GEMM_PATCH", "maybe", "1, true, yes, on, 0, false, no, off"),
        ("GEMM_PATCH_BACKEND", "cublas", "auto, te, native, fallback"),
        ("GEMM_PATCH_LOG_LEVEL", "loud", "DEBUG, INFO, WARNING, ERROR"),
        ("GEMM_PATCH_STRICT", "2", "1, true"),
    ],
)
def test_bad_value_names_variable_and_accepted_values(var, value, accepted):
    with pytest.raises(config.ConfigError) as info:
        config.load({var: value})
    message = str(info.value)
    assert message.startswith(f"{var}={value!r}")
    assert accepted in message


def test_backend_is_case_insensitive():
    assert config.load({"GEMM_PATCH_BACKEND": "TE"}).backend == "te"
