import pytest

from gemm_patch.engine import config


def test_defaults():
    cfg = config.load({}, switches=("GEMM_PATCH_APEX",))
    assert (cfg.enabled, cfg.strict, cfg.backend, cfg.log_level, cfg.allow_unverified) == \
        (True, False, "auto", "INFO", False)
    assert cfg.switch_on("GEMM_PATCH_APEX") and cfg.switch_on("GEMM_PATCH_ANYTHING_UNDECLARED")


@pytest.mark.parametrize("raw,expected", [("0", False), ("off", False), ("FALSE", False), ("1", True), (" yes ", True)])
def test_flags(raw, expected):
    assert config.load({"GEMM_PATCH": raw}).enabled is expected


@pytest.mark.parametrize(
    "var,value,accepted",
    [
        ("GEMM_PATCH", "maybe", "1, true, yes, on, 0, false, no, off"),
        ("GEMM_PATCH_BACKEND", "cublas", "auto, native, te, fallback"),
        ("GEMM_PATCH_LOG_LEVEL", "loud", "DEBUG, INFO, WARNING, ERROR"),
        ("GEMM_PATCH_STRICT", "2", "1, true"),
        ("GEMM_PATCH_ALLOW_UNVERIFIED", "perhaps", "1, true"),
        ("GEMM_PATCH_AUTO", "x", "1, true"),
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


def test_gemm_patch_0_beats_every_other_variable_even_bad_ones():
    env = {"GEMM_PATCH": "0", "GEMM_PATCH_STRICT": "1", "GEMM_PATCH_BACKEND": "cublas", "GEMM_PATCH_APEX": "2"}
    assert config.load(env, switches=("GEMM_PATCH_APEX",)).enabled is False
    assert config.enabled(env) is False
    assert config.enabled({"GEMM_PATCH": "bogus"}) is True  # load() reports it


def test_a_target_switch_is_read_and_validated():
    assert config.load({"GEMM_PATCH_FSDP_WGRAD": "off"}, switches=("GEMM_PATCH_FSDP_WGRAD",)) \
        .switch_on("GEMM_PATCH_FSDP_WGRAD") is False
    with pytest.raises(config.ConfigError, match="GEMM_PATCH_FSDP_WGRAD='2'"):
        config.load({"GEMM_PATCH_FSDP_WGRAD": "2"}, switches=("GEMM_PATCH_FSDP_WGRAD",))


def test_every_target_has_its_own_switch_variable():
    from gemm_patch.targets import REGISTRY

    assert {t.name: t.switch_variable for t in REGISTRY if t.name in ("fsdp-wgrad", "apex-wgrad")} == \
        {"fsdp-wgrad": "GEMM_PATCH_FSDP_WGRAD", "apex-wgrad": "GEMM_PATCH_APEX"}
