"""validation/frameworks/nemo on the CPU (no NeMo, no GPU): nemo_step.py's defaults are the H200 run's, its
readers of NeMo's decision (the layers' flags, the configs, the log records) count what they should,
a plain run never imports gemm_patch (importing it applies it) and still writes its JSON when
NeMo is missing, and the GPU script and the wheel list of its README.md agree with
pack_wheels.sh."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from validation.frameworks.nemo import nemo_step as ns

ROOT = Path(__file__).resolve().parents[2]
NEMO = ROOT / "validation" / "frameworks" / "nemo"


class Node:
    """A module tree as ``.modules()`` walks it."""

    def __init__(self, children=(), **attributes):
        self.children = list(children)
        self.__dict__.update(attributes)

    def modules(self):
        yield self
        for child in self.children:
            yield from child.modules()


class ColumnParallelLinear(Node):
    pass


class TELayerNormColumnParallelLinear(Node):
    pass


def test_defaults_are_the_h200_run():
    a = ns.parse([])
    assert (a.layers, a.hidden, a.seq, a.steps) == (2, 256, 512, 3)
    assert a.fusion == "on" and a.entry == "train" and a.sharding == "optim_grads_params"
    assert a.global_batch // a.micro_batch == 2  # two micro-batches a step: accumulation happens


def test_fusion_by_layer_counts_instance_flags_per_class():
    cfg = type("Config", (), {"gradient_accumulation_fusion": False})()
    tree = Node([
        ColumnParallelLinear(gradient_accumulation_fusion=True),
        ColumnParallelLinear(gradient_accumulation_fusion=False),
        TELayerNormColumnParallelLinear(fuse_wgrad_accumulation=True),
        Node(config=cfg),  # a config attribute is not a layer's flag
    ])
    assert ns.fusion_by_layer(tree) == {
        "ColumnParallelLinear.gradient_accumulation_fusion": {"on": 1, "off": 1},
        "TELayerNormColumnParallelLinear.fuse_wgrad_accumulation": {"on": 1, "off": 0},
    }


def test_configs_fusion_lists_each_config_once():
    shared = type("Config", (), {})()
    shared.gradient_accumulation_fusion = False
    other = type("Config", (), {})()
    other.gradient_accumulation_fusion = True
    tree = Node([Node(config=shared), Node(config=shared), Node(config=other), Node(config=object())])
    assert ns.configs_fusion(tree) == [False, True]


def test_watch_keeps_the_fusion_records_only():
    watch = ns.Watch()
    loggers = [logging.getLogger(n) for n in ("nemo_logger", "gemm_patch")]
    for log in loggers:
        log.addFilter(watch)
    try:
        loggers[0].warning("Setting module.config.gradient_accumulation_fusion to False for MCore FSDP.")
        loggers[0].warning("Setting ddp_config.use_megatron_fsdp to True for MCore FSDP.")
        loggers[1].warning("nemo-fsdp-gaf: NeMo keeps gradient_accumulation_fusion=True with Megatron-FSDP (x)")
    finally:
        for log in loggers:
            log.removeFilter(watch)
    assert watch.records == [
        "nemo_logger WARNING: Setting module.config.gradient_accumulation_fusion to False for MCore FSDP.",
        "gemm_patch WARNING: nemo-fsdp-gaf: NeMo keeps gradient_accumulation_fusion=True with Megatron-FSDP (x)",
    ]


def run_step(tmp_path, env_extra: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict, bool]:
    """nemo_step.main in a fresh interpreter where ``import nemo`` fails; returns the process, the
    JSON and whether gemm_patch got imported."""
    out = tmp_path / "r.json"
    code = (f"import sys; sys.modules['nemo'] = None; from validation.frameworks.nemo import nemo_step; "
            f"rc = nemo_step.main(['--out', {str(out)!r}]); "
            "print('GEMM_PATCH_IMPORTED', 'gemm_patch' in sys.modules); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    return r, json.loads(out.read_text()), "GEMM_PATCH_IMPORTED True" in r.stdout


def test_a_plain_run_without_nemo_writes_its_failure_and_never_imports_gemm_patch(tmp_path):
    r, result, imported = run_step(tmp_path, {})
    assert r.returncode == 1, r.stdout + r.stderr
    assert result["outcome"] == "failed" and result["error"].startswith("ModuleNotFoundError")
    assert result["gemm_patch_status"] is None and not result["gemm_patch_run"]
    assert not imported
    assert "[nemo_step] gemm_patch: gemm_patch not active (plain run)" in r.stdout


def test_under_gemm_patch_run_the_status_is_recorded(tmp_path):
    r, result, imported = run_step(tmp_path, {"GEMM_PATCH_AUTO": "1"})
    assert r.returncode == 1 and imported and result["gemm_patch_run"]
    assert result["gemm_patch_status"][0].startswith("gemm_patch ")
    assert len(result["gemm_patch_status"]) > 1  # the report's lines, whatever gemm_patch lists there


def test_the_watch_leaves_gemm_patch_its_console_handler(tmp_path):
    """gemm_patch adds its stderr handler only to a handler-less logger: watching must not stop it."""
    code = ("import logging; from validation.frameworks.nemo import nemo_step; "
            "logging.getLogger('gemm_patch').addFilter(nemo_step.Watch()); "
            "from gemm_patch.engine.report import emit; emit(logging.INFO, 'nemo-fsdp-gaf: a line')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    env.update(PYTHONPATH=str(ROOT), GEMM_PATCH="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "nemo-fsdp-gaf: a line" in r.stderr, r.stdout + r.stderr


def pack_pins() -> dict[str, str]:
    text = (NEMO / "pack_wheels.sh").read_text()
    pins = {}
    for block in re.findall(r"^(?:PINS|SDISTS)=\((.*?)\)", text, re.S | re.M):
        for spec in re.findall(r"(\S+)==(\S+)", block):
            assert spec[0] not in pins, f"{spec[0]} pinned twice"
            pins[spec[0]] = spec[1]
    return pins


def test_pack_list_and_readme_table_agree():
    pins = pack_pins()
    assert len(pins) == 46 and pins["nemo-toolkit"] == "2.7.3" and pins["lightning"] == "2.4.0"
    readme = (NEMO / "README.md").read_text()
    table = readme.split("## Wheels", 1)[1].split("## Checked", 1)[0]
    cells = {m.group(1).lower(): m.group(2) for m in re.finditer(r"\| ([\w.-]+) (\d[\w.]*)", table)}
    assert cells.pop("megatron-core") == "0.15.3"
    assert re.search(r"^\$PY -m pip download .* megatron-core==0\.15\.3$", (NEMO / "pack_wheels.sh").read_text(), re.M)
    assert cells == pins


def test_device_script_runs_every_configuration_and_compares_against_fusion_off():
    script = NEMO / "run_h200.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    (runs,) = re.findall(r'RUNS=\$\{RUNS:-"([^"]+)"\}', text)
    assert set(runs.split()) == {"gaf_tied", "off_tied", "gaf_untied", "off_untied", "patched_tied", "plain_tied"}
    for needed in ("source .devkit/setup.sh", "--target /tmp/gp/mc0153 .nemo273/mc/*.whl", "mcore 0.15.3",
                   "import megatron.core.inference.unified_memory", "--no-index --no-deps",
                   "env GEMM_PATCH_NEMO_FSDP_GAF=1 python3 -m gemm_patch run --",
                   "-m validation.frameworks.nemo.nemo_step",
                   '--grad-dump "$W/dumps/$name.pt"', "-m validation.parity.compare_grads --batch",
                   'off_${r#*_}.pt', "MASTER_PORT=$((29500 + $2))"):
        assert needed in text, needed
    # one file comes back (the device returns at most 8)
    assert re.findall(r'\$OUT/[\w.$]+', text) == ['$OUT/nemo_h200.tgz']


def test_grad_dump_is_optional_and_a_failure_is_recorded_not_raised(capsys):
    assert ns.parse([]).grad_dump is None
    assert ns.parse(["--grad-dump", "/tmp/x.pt"]).grad_dump == "/tmp/x.pt"
    result = {}
    ns.dump_first_step(object(), "/tmp/never.pt", result)  # no trainer.strategy: the dump fails
    assert result["grad_dump"]["path"] == "/tmp/never.pt" and "AttributeError" in result["grad_dump"]["error"]
    assert "grad dump FAILED" in capsys.readouterr().out


def test_tied_embeddings_default_to_nemos_and_can_be_untied():
    # NeMo's GPTConfig ties them; the H200 run on megatron-core 0.15.3 failed there (upstream).
    assert ns.parse([]).tied == "on"
    assert ns.parse(["--tied", "off"]).tied == "off"
    source = (NEMO / "nemo_step.py").read_text()
    assert 'share_embeddings_and_output_weights=args.tied == "on"' in source
